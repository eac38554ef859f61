"""The verify cost curve the welcome advertises: a forward of fewer nodes never costs more."""

from __future__ import annotations

from cloud_verifier.cost import monotone


def test_a_curve_measured_under_load_is_capped_by_larger_forwards() -> None:
    busy = {1: 1303.0, 2: 1038.0, 4: 818.0, 8: 882.0, 16: 1257.0, 32: 2144.0}
    assert monotone(busy) == {1: 818.0, 2: 818.0, 4: 818.0, 8: 882.0, 16: 1257.0, 32: 2144.0}
    quiet = {1: 505.8, 2: 513.0, 4: 526.1, 8: 634.6}
    assert monotone(quiet) == quiet
    assert list(monotone({8: 3.0, 1: 1.0})) == [1, 8]
