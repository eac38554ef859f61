"""The live verify cost curve: forward ms by tree nodes, measured at start-up and then refreshed
from every forward the engine runs.

A start-up measurement (cost.py) is a few forwards at one moment: taken while the machine was busy
it stays wrong for the server's life (on a shared 2-core machine it said 119 ms for a one-row
forward that then ran at ~70 ms), and it is cached on disk, so the next start reads it back. The
clients size their trees by the curve (welcome.verify_cost_ms) and the engine plans its batch wait
and stall checks by it (`Engine.cost_ms`), so `LiveCost` corrects it from the engine's own steps.

The curve is kept at buckets of N tree nodes (a forward of N + 1 rows: row 0 plus N nodes; N = 0 is
one row, a stream step or an `ar` token): 0, the start-up curve's N, and powers of two, grown as far
as the largest forward seen (prefill chunks of hundreds of rows). A forward of R rows, however many
sessions and prefill chunks share it, is an observation at N = R - 1.

The convergence rule:

- The prior: the start-up curve, made non-decreasing (`cost.monotone`). Where it measured no N: 0
  costs what its smallest N costs, the N past its largest up to TREE_REACH cost its largest, and
  beyond that a forward costs in proportion to its rows (a prefill's cost grows with its rows).
- An observation is a ratio, its ms over the prior at its own N. It is kept by the nearest bucket
  (by rows, on a log scale: its last WINDOW) and by its region's pool (the last WINDOW ratios of
  the region, starting as PRIOR_WEIGHT ratios of 1). Regions: the tree region, N <= TREE_REACH,
  where rounds are; past it the prefill region, whose pool holds every forward's ratio.
- A bucket's guess (what it would be without forwards of its own): the ratio of the nearest
  settled buckets of its region (PRIOR_WEIGHT + 1 = 3 forwards or more; between two, interpolated
  on the log-rows scale; past the last, the last's), the prefill region's from settled buckets of
  either region; with none settled, the median of its region's pool.
- A bucket's ratio: settled, the median of its own window (the prior is out: its own forwards
  outnumber the two it counted as); with one or two forwards of its own, the median of them and
  PRIOR_WEIGHT copies of its guess (the prior counts as two forwards); with none, its guess.
- The curve: prior x ratio at each bucket, then non-decreasing in N (each bucket at most any larger
  bucket's ms, as `cost.monotone`: other work on the machine only ever adds time), linear in N
  between buckets and in proportion to rows past the last; never below MIN_MS.

What it gives: a start-up curve off by a factor, then forwards of any sizes of one region at their
true cost: after one the curve is still the prior; after THREE every bucket of the region reads
the true cost, sizes never run included (three forwards of one size: exact, halfway after two).
So a prefill (hundreds of rows) moves only the prefill region: the tree region's pool and buckets
never see it. One forward in three slowed by anything else on the machine does not move a
bucket's median (one in eight once its window is full); a lasting change in the machine's speed
is followed within WINDOW // 2 + 1 = 5 forwards of a size.

The forward time observed is the engine step's wall time (the packed forward, the verification and
the commit: what a round waits for), as `Verdict.verify_ms` reports it.

Threads: `observe` (the engine's loop) takes a lock, updates the windows and publishes a new
immutable `CostSnapshot`; every reader (`curve`, `forward_ms`, ... on any thread) reads the snapshot
published last, without the lock.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from cloud_verifier.cost import monotone
from shared.verify_cost import MAX_VERIFY_MS

WINDOW = 8  # the ratios a bucket keeps (its last forwards)
PRIOR_WEIGHT = 2  # the start-up curve counts as this many forwards in each window
TREE_REACH = 64  # the tree region: N up to here (rounds); past it, prefills
MAX_NODES = 1 << 20  # the largest bucket (a forward of a million rows)
MIN_MS = 0.001  # no forward is free: a curve of 0 ms is refused (shared.verify_cost)
MIN_MARGINAL_MS = 0.01  # the least a verdict's marginal_ms says a round adds
VERDICT_NODES = (0, 1, 2, 4, 8, 16, 32, 64)  # the keys of a verdict's forward_ms / marginal_ms


@dataclass(frozen=True)
class CostSnapshot:
    """The curve at one moment: ms at each bucket N (ascending, non-decreasing)."""

    nodes: tuple[int, ...]
    ms: tuple[float, ...]

    def at(self, n: int) -> float:
        """ms of a forward of n nodes (n + 1 rows): linear between buckets, in proportion to rows
        past the last."""
        n = max(0, n)
        top = self.nodes[-1]
        if n >= top:
            return self.ms[-1] * (n + 1) / (top + 1)
        i = bisect.bisect_right(self.nodes, n) - 1
        x0, x1 = self.nodes[i], self.nodes[i + 1]
        y0, y1 = self.ms[i], self.ms[i + 1]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


def _lograte(n: int) -> float:
    return math.log(n + 1)


class LiveCost:
    """The verify cost curve, from the start-up curve `prior` ({N >= 1 nodes: ms}; a {0: ms} entry
    is taken too) refreshed by `observe` (module docstring: the rule). `curve()` keeps the prior's
    N >= 1 keys; the verdict maps reach as far as the largest."""

    def __init__(self, prior: Mapping[int, float]) -> None:
        if not prior or any(not (math.isfinite(v) and v > 0) for v in prior.values()):
            raise ValueError(f"a prior cost curve needs finite ms > 0 at some N, got {dict(prior)}")
        shape = monotone({int(n): float(v) for n, v in prior.items() if n >= 0})
        if 0 not in shape:
            shape = {0: shape[min(shape)], **shape}
        self._prior = CostSnapshot(tuple(shape), tuple(shape.values()))
        self._keys = tuple(sorted(n for n in shape if n >= 1))
        self.reach = max(TREE_REACH, self._keys[-1] if self._keys else 0)
        nodes = {0, *shape, *(1 << k for k in range(self.reach.bit_length()) if 1 << k <= self.reach)}
        self._nodes: list[int] = sorted(nodes)
        self._windows: dict[int, deque[float]] = {n: deque(maxlen=WINDOW) for n in self._nodes}
        self._seen: dict[int, int] = {}  # bucket: forwards seen there
        self._tree_pool: deque[float] = deque([1.0] * PRIOR_WEIGHT, maxlen=WINDOW)
        self._all_pool: deque[float] = deque([1.0] * PRIOR_WEIGHT, maxlen=WINDOW)
        self._lock = threading.Lock()
        self.forwards = 0  # observations taken
        self._snap = self._build()

    # ------------------------------------------------------------------ the prior
    def prior_ms(self, n: int) -> float:
        """The start-up curve at n nodes, extended as the module docstring says."""
        p = self._prior
        top = p.nodes[-1]
        if n <= top:
            return p.at(n)
        if n <= self.reach:
            return p.ms[-1]
        return p.ms[-1] * (n + 1) / (self.reach + 1)

    # ------------------------------------------------------------------ writes (the engine's loop)
    def observe(self, rows: int, seconds: float, context_tokens: int | None = None) -> None:
        """A forward of `rows` rows (every session's and prefill chunk's together) took `seconds`.
        `context_tokens` (the committed tokens its sessions attend to) is accepted for the record:
        the curve is not keyed by context; its windows follow a generation's growing context by
        recency. Forwards of no rows or no measurable time are ignored."""
        if rows < 1 or not (math.isfinite(seconds) and seconds > 0):
            return
        n = min(rows - 1, MAX_NODES)
        ratio = seconds * 1e3 / self.prior_ms(n)
        with self._lock:
            while self._nodes[-1] < n:
                top = self._nodes[-1] * 2
                self._nodes.append(top)
                self._windows[top] = deque(maxlen=WINDOW)
            b = self._bucket(n)
            self._windows[b].append(ratio)
            self._seen[b] = self._seen.get(b, 0) + 1
            if b <= self.reach:
                self._tree_pool.append(ratio)
            self._all_pool.append(ratio)
            self.forwards += 1
            self._snap = self._build()

    def _bucket(self, n: int) -> int:
        """The bucket nearest n on the log-rows scale."""
        i = bisect.bisect_left(self._nodes, n)
        if i < len(self._nodes) and self._nodes[i] == n:
            return n
        lo, hi = self._nodes[max(i - 1, 0)], self._nodes[min(i, len(self._nodes) - 1)]
        x = _lograte(n)
        return lo if x - _lograte(lo) <= _lograte(hi) - x else hi

    def _ratio(self, b: int, guess: float) -> float:
        """Bucket b's ratio: the median of its last forwards' and, until they outnumber it (not
        settled), PRIOR_WEIGHT copies of `guess`."""
        own = list(self._windows[b])
        priors = PRIOR_WEIGHT if self._seen.get(b, 0) <= PRIOR_WEIGHT else 0
        return statistics.median(own + [guess] * priors) if own else guess

    def _build(self) -> CostSnapshot:
        """The snapshot of the windows now (under the lock, or before anyone else sees self)."""
        pools = statistics.median(self._tree_pool), statistics.median(self._all_pool)

        def pool(b: int) -> float:
            return pools[0] if b <= self.reach else pools[1]

        settled = {b: self._ratio(b, pool(b)) for b, k in self._seen.items() if k > PRIOR_WEIGHT}
        every = sorted(settled)
        tree = [b for b in every if b <= self.reach]
        ms: dict[int, float] = {}
        for b in self._nodes:
            if b in settled:
                r = settled[b]
            else:
                near = tree if b <= self.reach else every
                r = self._ratio(b, _between(b, near, settled) if near else pool(b))
            ms[b] = min(max(self.prior_ms(b) * r, MIN_MS), MAX_VERIFY_MS)
        mono = monotone(ms)
        return CostSnapshot(tuple(mono), tuple(mono.values()))

    # ------------------------------------------------------------------ reads (any thread)
    @property
    def snapshot(self) -> CostSnapshot:
        return self._snap

    def curve(self) -> dict[int, float]:
        """{N: ms} at the start-up curve's N >= 1 (welcome.verify_cost_ms, Engine.cost_ms): each
        finite, > 0 and at most MAX_VERIFY_MS."""
        snap = self._snap
        return {n: _ms(snap.at(n)) for n in self._keys}

    def forward_ms(self, nodes: int, other_rows: int = 0) -> float:
        """ms of a forward holding `other_rows` rows of other sessions and this round's nodes + 1."""
        return _ms(self._snap.at(max(other_rows, 0) + max(nodes, 0)))

    def marginal_ms(self, nodes: int, other_rows: int = 0) -> float:
        """What this round's nodes + 1 rows add to a forward of `other_rows` rows (none: the whole
        forward), at least MIN_MARGINAL_MS."""
        return _marginal(self._snap, nodes, other_rows)

    def verdict_maps(self, other_rows: int = 0) -> tuple[dict[int, float], dict[int, float]]:
        """A verdict's (forward_ms, marginal_ms) for N in VERDICT_NODES up to the curve's largest N,
        from one snapshot: values finite and > 0 (cost_curve_error(..., allow_zero=True))."""
        snap = self._snap
        reach = self._keys[-1] if self._keys else 0
        keys = [n for n in VERDICT_NODES if n <= reach]
        other = max(other_rows, 0)
        forward = {n: _ms(snap.at(other + n)) for n in keys}
        return forward, {n: _marginal(snap, n, other) for n in keys}


def _between(b: int, observed: list[int], ratios: Mapping[int, float]) -> float:
    """The ratio at bucket b from the buckets `observed` (not empty): its nearest ones' (between
    two, interpolated on the log-rows scale)."""
    i = bisect.bisect_left(observed, b)
    if i == 0:
        return ratios[observed[0]]
    if i == len(observed):
        return ratios[observed[-1]]
    lo, hi = observed[i - 1], observed[i]
    t = (_lograte(b) - _lograte(lo)) / (_lograte(hi) - _lograte(lo))
    return ratios[lo] + (ratios[hi] - ratios[lo]) * t


def _ms(v: float) -> float:
    return min(max(round(v, 3), MIN_MS), MAX_VERIFY_MS)


def _marginal(snap: CostSnapshot, nodes: int, other_rows: int) -> float:
    nodes, other = max(nodes, 0), max(other_rows, 0)
    whole = snap.at(other + nodes)
    alone = snap.at(other - 1) if other > 0 else 0.0
    return min(max(round(whole - alone, 3), MIN_MARGINAL_MS), MAX_VERIFY_MS)
