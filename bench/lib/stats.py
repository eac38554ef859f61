"""The statistics of the benches: one median, one percentile, the median ms of a timed call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence


def median(xs: Iterable[float], digits: int | None = None) -> float | None:
    """The median of `xs` (rounded to `digits` when given); None when there is none."""
    values = list(xs)
    if not values:
        return None
    m = statistics.median(values)
    return m if digits is None else round(m, digits)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (no interpolation: p99 of few rounds is an observed round)."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 100)) - 1))
    return ordered[k]


def median_ms(
    fn: Callable[[], object], repeats: int, *, warmup: int = 0, sync: Callable[[], None] | None = None
) -> float:
    """The median ms of `repeats` calls of `fn` after `warmup` untimed ones; `sync` (a device's
    synchronize) runs before and after each timed call, inside nothing timed but the call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
