"""bench.e2e's per-mode summary: what the benches and the issues' tables read."""

from __future__ import annotations

from typing import Any

import pytest

from bench.e2e import ModeRuns
from edge_client.stats import Generation, GenerationStats


def _gen(n: int, **stats: Any) -> Generation:
    return Generation(prompt_tokens=[1], tokens=list(range(n)), stats=GenerationStats(tokens=n, **stats))


def test_round_times_pool_every_generation() -> None:
    runs = ModeRuns()
    # generation 1: 3 rounds, two drafted on the critical path (one was a pre-speculation hit)
    runs.add(
        _gen(
            9,
            rounds=3,
            draft_ms=[10.0, 20.0],
            verify_ms=[5.0, 6.0, 7.0],
            rtt_ms=[50.0, 52.0],
            prespec_ms=30.0,
            prespec_sent=2,
            prespec_cancelled=3,
            wall_s=0.9,
        ),
        forwards=3,
    )
    # generation 2: 1 round
    runs.add(_gen(4, rounds=1, draft_ms=[30.0], verify_ms=[9.0], rtt_ms=[60.0], wall_s=0.2), forwards=1)
    s = runs.summary()
    assert s["draft_ms_per_round"] == pytest.approx(60.0 / 4)  # critical-path drafting over all rounds
    assert s["verify_ms_per_round"] == pytest.approx(6.5)  # median of 5, 6, 7, 9
    assert s["rtt_ms_per_round"] == pytest.approx(52.0)  # median of 50, 52, 60
    assert s["prespec_draft_ms_per_round"] == pytest.approx(30.0 / 4)
    assert s["prespec_trees_per_round"] == pytest.approx(2 / 4)
    assert s["prespec_cancelled_per_round"] == pytest.approx(3 / 4)
    assert s["tau_pooled"] == pytest.approx(13 / 4)
    assert s["ms_per_token"] == pytest.approx((100.0 + 50.0) / 2)  # median of the per-generation figures
    assert s["target_forwards_per_token"] == pytest.approx(
        (3 / 9 + 1 / 4) / 2, abs=1e-4
    )  # rounded to 4 places


def test_empty_runs_summarise_to_zeros() -> None:
    s = ModeRuns().summary()
    assert s["draft_ms_per_round"] == 0.0 and s["rtt_ms_per_round"] == 0.0 and s["hit_rate"] is None
