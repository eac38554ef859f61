"""bench.robustness.soak's memory figures: growth per half after warm-up tells a leak from a pool filling
up."""

from __future__ import annotations

import pytest

from bench.robustness.soak import plateau


def test_plateau_tells_a_leak_from_a_pool_that_fills_up() -> None:
    seconds = 100.0
    # fills up during the first half after warm-up (t 20..60), then flat
    filling = [(float(t), 100.0 + min(max(t - 20, 0), 40) / 2) for t in range(0, 101)]
    p = plateau(filling, seconds)
    assert p["rss_growth_first_half"] == pytest.approx(0.18, abs=0.02)
    assert p["rss_growth_second_half"] == 0.0
    # grows steadily: the second half grows too
    leak = [(float(t), 100.0 + t) for t in range(0, 101)]
    p = plateau(leak, seconds)
    assert p["rss_growth_second_half"] is not None and p["rss_growth_second_half"] > 0.2


def test_plateau_without_samples_says_nothing() -> None:
    assert plateau([], 60.0) == {"rss_growth_first_half": None, "rss_growth_second_half": None}
