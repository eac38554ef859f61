from __future__ import annotations

import numpy as np
import pytest

from edge_client.speculation.estimates import (
    AcceptanceCalibration,
    choose_budget,
    expected_tokens,
    geometric_gains,
    verify_ms,
)

CPU_COST = {1: 40.0, 4: 58.0, 8: 55.0, 16: 68.0, 32: 91.0, 64: 143.0}  # docs/architecture.md §8
GPU_COST = {1: 12.0, 4: 12.0, 8: 12.1, 16: 12.2, 32: 12.4, 64: 12.8}


def test_cost_curve_interpolates_and_is_flat_below() -> None:
    assert verify_ms(CPU_COST, np.array([1, 8, 12, 64])).tolist() == [40.0, 55.0, 61.5, 143.0]
    assert verify_ms({4: 10.0, 8: 20.0}, np.array([1])).tolist() == [10.0]
    with pytest.raises(ValueError, match="empty"):
        verify_ms({}, np.array([1]))


def test_expected_tokens_counts_the_bonus() -> None:
    assert expected_tokens([0.5, 0.9, 0.1], 2) == pytest.approx(2.4)
    assert expected_tokens([], 3) == 1.0


def test_flat_cost_buys_every_useful_node() -> None:
    gains = geometric_gains(0.9, 64)
    assert choose_budget({1: 12.0, 64: 12.0}, gains) == 64  # a free node is always worth it
    assert choose_budget(GPU_COST, gains) > 32  # nearly free: stop only where gains are ~0.001


def test_steep_cost_buys_few_nodes_and_rtt_buys_more() -> None:
    gains = geometric_gains(0.6, 64)
    local = choose_budget(CPU_COST, gains)
    far = choose_budget(CPU_COST, gains, rtt_ms=100.0)
    assert local < 16
    assert far >= local
    # the choice is the argmax of tokens per ms
    n = np.arange(1, 65)
    rate = (1 + np.cumsum(gains)) / verify_ms(CPU_COST, n)
    assert local == int(n[np.argmax(rate)])


def test_draft_cost_and_limits_cap_the_budget() -> None:
    gains = geometric_gains(0.95, 64)
    assert choose_budget(GPU_COST, gains, draft_ms_per_node=5.0) < choose_budget(GPU_COST, gains)
    assert choose_budget(GPU_COST, gains, max_nodes=10) == 10
    assert choose_budget(GPU_COST, gains[:5]) == 5  # no more nodes than known gains
    assert choose_budget(GPU_COST, []) == 1


def test_calibration_follows_observed_acceptance() -> None:
    cal = AcceptanceCalibration()
    for _ in range(30):
        cal.update(expected_accepted=4.0, accepted=2)
    assert cal.factor == pytest.approx(0.5, abs=0.01)
    cal.update(expected_accepted=0.0, accepted=3)  # nothing expected: no information
    assert cal.factor == pytest.approx(0.5, abs=0.01)
    assert choose_budget(CPU_COST, geometric_gains(0.9, 64), calibration=cal.factor) <= choose_budget(
        CPU_COST, geometric_gains(0.9, 64)
    )
