"""Optional fields a client asks for in hello.features (PROTOCOL.md section 10): verdict.gap_ms and
welcome.limits.max_pending_bytes reach only a client that named them, so a client of an earlier
release (whose strict decoder refuses unknown fields) gets the frames it always got; the server's
bound on the bytes of a session's pending trees (PROTOCOL.md section 5)."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from shared.errors import ErrorCode, ProtocolError
from shared.messages import (
    FEATURE_GAP_MS,
    FEATURE_PENDING_BYTES,
    FEATURES,
    Cancel,
    Error,
    Hello,
    Mode,
    Prompt,
    SessionLimits,
    Stale,
    Tree,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.protocol import ServerProtocol, VerifyTree
from shared.tree import TokenTree

V = 50
LIMITS = SessionLimits(
    max_nodes=8, max_depth=4, max_pending=8, max_bytes=4096, max_context=64, max_pending_bytes=200
)


def _server(features: tuple[str, ...] = ()) -> ServerProtocol:
    srv = ServerProtocol(vocab_size=V, limits=LIMITS)
    srv.receive(encode(Hello("f" * 64, features=features)))
    srv.welcome(Welcome("s", "m", V, (0,), (Mode.GREEDY,), LIMITS, {1: 1.0}))
    srv.receive(encode(Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY, max_new_tokens=20)))
    return srv


def _frames(srv: ServerProtocol) -> list[dict[str, object]]:
    return [msgpack.unpackb(f) for f in srv.data_to_send()]


def _verdict(round_: int, tokens: list[int], committed_len: int, gap_ms: float | None) -> Verdict:
    return Verdict(
        round_, np.array(tokens), np.zeros(0, np.int32), True, committed_len, verify_ms=5.0, gap_ms=gap_ms
    )


def _old_verdict_decoder(frame: bytes) -> None:
    """What a decoder of the release before gap_ms does with a verdict: every key it does not know
    is an error (it read exactly these)."""
    known = {"type", "round", "tokens", "accepted_nodes", "has_bonus", "committed_len", "verify_ms", "done"}
    extra = set(msgpack.unpackb(frame)) - known - {"next_round", "reason"}
    if extra:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "unknown field", sorted(extra)[0], fatal=True)


def test_a_client_without_features_gets_the_frames_of_the_earlier_release() -> None:
    srv = ServerProtocol(vocab_size=V, limits=LIMITS)
    srv.receive(encode(Hello("f" * 64)))
    welcome = Welcome("s", "m", V, (0,), (Mode.GREEDY,), LIMITS, {1: 1.0})
    srv.welcome(welcome)
    (frame,) = srv.data_to_send()
    # byte for byte the welcome without the new limit
    plain = dataclasses.replace(welcome, limits=dataclasses.replace(LIMITS, max_pending_bytes=None))
    assert frame == encode(plain)
    assert "max_pending_bytes" not in msgpack.unpackb(frame)["limits"]
    # the server still enforces what it did not advertise
    assert srv.limits.max_pending_bytes == 200
    srv.receive(encode(Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY)))
    srv.verdict(_verdict(0, [4], 4, None))
    srv.data_to_send()
    assert isinstance(srv.receive(encode(Tree(1, TokenTree.chain([5], base=4))))[0], VerifyTree)
    srv.verdict(_verdict(1, [5, 6], 6, 12.5))
    (frame,) = srv.data_to_send()
    _old_verdict_decoder(frame)  # would raise on gap_ms
    assert frame == encode(_verdict(1, [5, 6], 6, None))


def test_the_features_asked_for_are_sent_and_unknown_names_are_ignored() -> None:
    srv = ServerProtocol(vocab_size=V, limits=LIMITS)
    srv.receive(encode(Hello("f" * 64, features=(FEATURE_GAP_MS, FEATURE_PENDING_BYTES, "teleport"))))
    assert srv.features == {FEATURE_GAP_MS, FEATURE_PENDING_BYTES, "teleport"}
    srv.welcome(Welcome("s", "m", V, (0,), (Mode.GREEDY,), LIMITS, {1: 1.0}))
    (w,) = srv.data_to_send()
    got = decode(w)
    assert isinstance(got, Welcome) and got.limits.max_pending_bytes == 200
    srv.receive(encode(Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY)))
    srv.verdict(_verdict(0, [4], 4, 3.0))  # round 0 answers the prompt: never a gap
    (v0,) = srv.data_to_send()
    assert "gap_ms" not in msgpack.unpackb(v0)
    srv.receive(encode(Tree(1, TokenTree.chain([5], base=4))))
    srv.verdict(_verdict(1, [5, 6], 6, 12.5))
    (v1,) = srv.data_to_send()
    got = decode(v1)
    assert isinstance(got, Verdict) and got.gap_ms == 12.5
    with pytest.raises(ProtocolError, match="unknown field"):
        _old_verdict_decoder(v1)


def test_one_feature_alone() -> None:
    srv = _server(features=(FEATURE_GAP_MS,))
    (w,) = _frames(srv)
    limits = w["limits"]
    assert isinstance(limits, dict) and "max_pending_bytes" not in limits
    srv.verdict(_verdict(0, [4], 4, None))
    srv.receive(encode(Tree(1, TokenTree.chain([5], base=4))))
    srv.data_to_send()
    srv.verdict(_verdict(1, [5, 6], 6, 0.25))
    (v,) = _frames(srv)
    assert v["gap_ms"] == 0.25


def test_hello_features_round_trip_and_a_hello_without_them_is_unchanged() -> None:
    h = Hello("ab" * 32, features=FEATURES)
    got = decode(encode(h))
    assert isinstance(got, Hello) and got.features == FEATURES
    assert "features" not in msgpack.unpackb(encode(Hello("ab" * 32)))
    bad = msgpack.packb({"type": "hello", "version": 1, "vocab_fingerprint": "x", "features": [1]})
    with pytest.raises(ProtocolError) as err:
        decode(bad)
    assert err.value.field == "features" and err.value.fatal


def _cond_tree(r: int, base: int, cond: list[int]) -> Tree:
    return Tree(r, TokenTree.chain([7], base=base, cond=cond))


@pytest.mark.parametrize("features", [FEATURES, ()], ids=["asked", "not asked"])
def test_pending_trees_are_bounded_in_bytes_and_freed_when_verified_or_stale(
    features: tuple[str, ...],
) -> None:
    size = len(encode(_cond_tree(1, 3, [4])))  # every tree below has a frame of this size
    limits = dataclasses.replace(LIMITS, max_pending_bytes=2 * size + size // 2)  # two fit, not three
    srv = ServerProtocol(vocab_size=V, limits=limits)
    srv.receive(encode(Hello("f" * 64, features=features)))
    srv.welcome(Welcome("s", "m", V, (0,), (Mode.GREEDY,), limits, {1: 1.0}))
    srv.receive(encode(Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY)))
    srv.data_to_send()
    # the prompt's round 0 is in flight (S = 1 2 3): trees assuming its outcome wait
    assert srv.receive(encode(_cond_tree(1, 3, [4]))) == []
    assert srv.receive(encode(_cond_tree(2, 3, [5]))) == []
    srv.receive(encode(_cond_tree(3, 3, [6])))
    (err,) = srv.data_to_send()
    e = decode(err)
    assert isinstance(e, Error) and e.code is ErrorCode.TOO_MANY_PENDING and not e.fatal and e.round == 3
    assert f"{3 * size} bytes, over max_pending_bytes {2 * size + size // 2}" in e.message
    assert srv.gen is not None and sorted(srv.gen.pending) == [1, 2]
    assert srv.gen.pending_bytes == {1: size, 2: size}
    # round 0's verdict commits 4: tree 1 is verified next, tree 2 goes stale; both free their bytes
    nxt = srv.verdict(_verdict(0, [4], 4, None))
    assert nxt is not None and nxt.round == 1
    assert [type(decode(f)) for f in srv.data_to_send()] == [Stale, Verdict]
    assert srv.gen.pending == {} and srv.gen.pending_bytes == {}
    # room again: two more pending trees are taken while round 1 is in flight
    assert srv.receive(encode(_cond_tree(4, 4, [7]))) == []
    assert srv.receive(encode(_cond_tree(5, 4, [8]))) == []
    assert srv.data_to_send() == []
    assert sorted(srv.gen.pending) == [4, 5]
    # a cancel answers both stale and empties the count
    srv.receive(encode(Cancel()))
    assert srv.gen.pending_bytes == {}


def test_a_tree_verified_at_once_does_not_count_against_the_byte_bound() -> None:
    limits = dataclasses.replace(LIMITS, max_pending_bytes=10)  # smaller than any tree frame
    srv = ServerProtocol(vocab_size=V, limits=limits)
    srv.receive(encode(Hello("f" * 64)))
    srv.welcome(Welcome("s", "m", V, (0,), (Mode.GREEDY,), limits, {1: 1.0}))
    srv.receive(encode(Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY)))
    srv.verdict(_verdict(0, [4], 4, None))
    srv.data_to_send()
    (ev,) = srv.receive(encode(Tree(1, TokenTree.chain([5, 6], base=4))))
    assert isinstance(ev, VerifyTree)
    # while it is in flight, a conditional tree would be pending: over 10 bytes
    (ev,) = srv.receive(encode(Tree(2, TokenTree.chain([8], base=4, cond=[5, 6, 7]))))
    (err,) = srv.data_to_send()
    e = decode(err)
    assert isinstance(e, Error) and e.code is ErrorCode.TOO_MANY_PENDING


def test_no_byte_bound_when_the_limits_have_none() -> None:
    limits = dataclasses.replace(LIMITS, max_pending_bytes=None)
    srv = ServerProtocol(vocab_size=V, limits=limits)
    srv.receive(encode(Hello("f" * 64, features=FEATURES)))
    srv.welcome(Welcome("s", "m", V, (0,), (Mode.GREEDY,), limits, {1: 1.0}))
    (w,) = srv.data_to_send()
    assert "max_pending_bytes" not in msgpack.unpackb(w)["limits"]
    srv.receive(encode(Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY)))
    for r in range(1, 9):  # max_pending 8 trees of ~90 bytes: only the count limits them
        assert srv.receive(encode(Tree(r, TokenTree.chain([7] * 4, base=3, cond=[r])))) == []
    assert srv.data_to_send() == []


def test_the_default_limits_leave_room_for_an_outcome_cache() -> None:
    assert SessionLimits().max_pending >= 30
    assert SessionLimits().max_pending_bytes is None  # not advertised unless the server sets it
