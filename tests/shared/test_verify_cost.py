"""One rule for what a verifier may advertise and a client reads: the verify cost curve
(shared.verify_cost) and the session limits (SessionLimits.RANGES / check), applied by the
welcome's decoder and by the verifier's own checks alike."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from shared.errors import ProtocolError
from shared.messages import Mode, SessionLimits, Welcome, decode, encode
from shared.verify_cost import MAX_VERIFY_MS, cost_curve_error
from shared.wire import MAX_U31


def _welcome(**kw: Any) -> Welcome:
    fields: dict[str, Any] = {
        "session_id": "s",
        "model_id": "m",
        "vocab_size": 100,
        "eos_ids": (0,),
        "allowed_modes": (Mode.GREEDY,),
        "limits": SessionLimits(),
        "verify_cost_ms": {1: 4.0, 8: 6.5},
        "vocab_fingerprint": "ab" * 32,
    }
    fields.update(kw)
    return Welcome(**fields)


BAD_CURVES: list[dict[Any, Any]] = [
    {1: float("nan")},
    {1: float("inf")},
    {1: 0.0},
    {1: 1e308},
    {1: -1.0},
    {1: MAX_VERIFY_MS * 2},
    {0: 1.0},
]


@pytest.mark.parametrize("curve", BAD_CURVES, ids=repr)
def test_a_curve_that_is_no_forward_time_is_refused_by_the_client(curve: dict[int, float]) -> None:
    assert cost_curve_error(curve) is not None
    with pytest.raises(ProtocolError) as info:
        decode(encode(_welcome(verify_cost_ms=curve)))
    assert info.value.field == "verify_cost_ms"


@pytest.mark.parametrize("curve", [{}, {1: 0.001}, {1: 4.0, 64: MAX_VERIFY_MS}])
def test_a_usable_curve_is_read_as_sent(curve: dict[int, float]) -> None:
    assert cost_curve_error(curve) is None
    msg = decode(encode(_welcome(verify_cost_ms=curve)))
    assert isinstance(msg, Welcome) and msg.verify_cost_ms == curve


def test_a_non_ascii_digit_node_count_is_a_protocol_error() -> None:
    """'²'.isdigit() is true but int('²') fails: the decoder refused it with a ValueError."""
    import msgpack

    frame = msgpack.unpackb(encode(_welcome()), raw=False)
    frame["verify_cost_ms"] = {"²": 1.0}
    with pytest.raises(ProtocolError) as info:
        decode(msgpack.packb(frame))
    assert info.value.field == "verify_cost_ms"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_nodes", 0),
        ("max_depth", 0),
        ("max_pending", -1),
        ("max_bytes", 0),
        ("max_bytes", 4095),
        ("max_context", 0),
        ("max_draws", 0),
        ("max_row_draws", 0),
        ("max_q_ids", 0),
        ("max_q_row", 0),
        ("max_pending_bytes", 0),
        ("max_context", MAX_U31 + 1),
    ],
)
def test_limits_out_of_range_are_refused_by_check_and_by_the_client(name: str, value: int) -> None:
    limits = dataclasses.replace(SessionLimits(), **{name: value})
    with pytest.raises(ValueError, match=name):
        limits.check()
    with pytest.raises(ProtocolError) as info:
        decode(encode(_welcome(limits=limits)))
    assert info.value.field == f"limits.{name}"


def test_the_least_limits_of_the_rule_are_accepted_by_both() -> None:
    least = SessionLimits(**{name: lo for name, (lo, _) in SessionLimits.RANGES.items()})
    least.check()
    msg = decode(encode(_welcome(limits=least)))
    assert isinstance(msg, Welcome) and msg.limits == least
    SessionLimits().check()  # the defaults, and no max_pending_bytes
    with pytest.raises(ValueError, match="max_nodes"):
        SessionLimits(max_nodes=True).check()  # a bool is no count
