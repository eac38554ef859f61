from __future__ import annotations

import hashlib
import struct
from typing import Any, cast

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import ErrorCode, ProtocolError, SparseDist, SparseRows, TokenTree, vocab_fingerprint
from shared.messages import (
    Cancel,
    Close,
    Error,
    Hello,
    Message,
    Mode,
    Prompt,
    SessionLimits,
    Stale,
    Tree,
    Verdict,
    Welcome,
    WireLimits,
    decode,
    encode,
)
from shared.tree import Draws


def _stochastic_tree() -> TokenTree:
    q0 = SparseDist.from_weights([1, 2, 3], [30000, 30000, 5536])
    q1 = SparseDist.from_weights([4], [65536])
    draws = Draws(
        node=np.array([0, 1, 0, 2], np.int32),
        drafter=np.array([0, 0, 0, 1], np.int32),
        qrow=np.array([0, 0, 0, 1], np.int32),
        q=SparseRows.from_rows([q0, q1]),
    )
    return TokenTree.build([1, 2, 4], [-1, -1, 0], base=9, cond=[5, 6], draws=draws)


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.tolist() == b.tolist()
    if isinstance(a, TokenTree):
        assert isinstance(b, TokenTree)
        ok = (
            a.base == b.base
            and _same(a.tokens, b.tokens)
            and _same(a.parents, b.parents)
            and _same(a.cond, b.cond)
        )
        if a.draws is None or b.draws is None:
            return ok and a.draws is None and b.draws is None
        da, db = a.draws, b.draws
        return ok and all(
            _same(x, y)
            for x, y in [
                (da.node, db.node),
                (da.drafter, db.drafter),
                (da.qrow, db.qrow),
                (da.q.ptr, db.q.ptr),
                (da.q.ids, db.q.ids),
                (da.q.weights, db.q.weights),
            ]
        )
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


EXAMPLES: list[Message] = [
    Hello(vocab_fingerprint="ab" * 32, api_key="k", client="edge/0.1"),
    Hello(vocab_fingerprint="00" * 32),
    Welcome(
        session_id="s1",
        model_id="smollm2-135m",
        vocab_size=49152,
        eos_ids=(2, 0),
        allowed_modes=(Mode.GREEDY, Mode.MATCH, Mode.AR),
        limits=SessionLimits(),
        verify_cost_ms={1: 40.0, 16: 60.5},
        vocab_fingerprint="cd" * 32,
    ),
    Prompt(
        tokens=np.array([1, 2, 3]),
        mode=Mode.MATCH,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        seed=2**40,
        max_new_tokens=64,
        stop_ids=(2,),
        continue_=True,
    ),
    Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY, tree=TokenTree.build([4, 5], [-1, 0], base=3)),
    Prompt(tokens=np.arange(11), mode=Mode.RRS, temperature=1.0, tree=_stochastic_tree()),
    Tree(round=7, tree=TokenTree.build([4, 5, 6], [-1, 0, 0], base=12, cond=[8])),
    Tree(round=8, tree=_stochastic_tree()),
    Verdict(
        round=7,
        tokens=np.array([4, 5, 9]),
        accepted_nodes=np.array([0, 1]),
        has_bonus=True,
        committed_len=15,
        next_round=8,
        verify_ms=3.5,
        done=False,
    ),
    Verdict(
        round=0,
        tokens=np.array([2]),
        accepted_nodes=np.array([]),
        has_bonus=True,
        committed_len=4,
        done=True,
        reason="stop",
    ),
    Stale(round=9, reason="mismatch"),
    Error(ErrorCode.OUT_OF_RANGE, "token ids must be in [0, 10)", "tree.tokens", fatal=False, round=3),
    Error(ErrorCode.BAD_FRAME, "nope"),
    Cancel(),
    Close("bye"),
    Close(),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    frame = encode(msg)
    back = decode(frame)
    assert _same(msg, back)
    assert encode(back) == frame


def test_integer_arrays_are_raw_little_endian() -> None:
    frame = encode(Tree(round=1, tree=TokenTree.build([258, 3], [-1, 0], base=1)))
    raw = msgpack.unpackb(frame)
    assert raw["type"] == "tree"
    assert raw["tokens"] == struct.pack("<ii", 258, 3)
    assert raw["parents"] == struct.pack("<ii", -1, 0)
    q = _stochastic_tree().draws
    assert q is not None
    wire = msgpack.unpackb(encode(Tree(round=2, tree=_stochastic_tree())))["draws"]
    assert wire["q_wm1"] == np.array([29999, 29999, 5535, 65535], "<u2").tobytes()


def _frame(d: object) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(
    ("frame", "code", "field"),
    [
        (b"\xc1", ErrorCode.BAD_FRAME, "frame"),
        (b"", ErrorCode.BAD_FRAME, "frame"),
        (_frame([1, 2]), ErrorCode.BAD_FRAME, "frame"),
        (_frame({"type": "tree", "round": 1}) + b"\x00", ErrorCode.BAD_FRAME, "frame"),
        (_frame({"type": "nope"}), ErrorCode.UNKNOWN_TYPE, "type"),
        (_frame({"kind": "hello"}), ErrorCode.BAD_MESSAGE, "type"),
        (_frame({"type": "stale", "round": "1", "reason": "x"}), ErrorCode.BAD_MESSAGE, "round"),
        (_frame({"type": "stale", "round": True, "reason": "x"}), ErrorCode.BAD_MESSAGE, "round"),
        (_frame({"type": "stale", "round": 1, "reason": "x", "extra": 1}), ErrorCode.BAD_MESSAGE, "extra"),
        (
            _frame({"type": "tree", "round": 1, "base": 1, "cond": b"", "tokens": [1, 2], "parents": b""}),
            ErrorCode.BAD_MESSAGE,
            "tokens",
        ),
        (
            _frame(
                {
                    "type": "tree",
                    "round": 1,
                    "base": 1,
                    "cond": b"",
                    "tokens": b"\x01\x00\x00",
                    "parents": b"",
                }
            ),
            ErrorCode.BAD_MESSAGE,
            "tokens",
        ),
        (_frame({"type": "prompt", "tokens": b"", "mode": "fast"}), ErrorCode.BAD_MESSAGE, "mode"),
        (
            _frame({"type": "prompt", "tokens": b"", "mode": "mss", "top_p": 1.5}),
            ErrorCode.BAD_MESSAGE,
            "top_p",
        ),
        (
            _frame({"type": "prompt", "tokens": b"", "mode": "mss", "temperature": float("nan")}),
            ErrorCode.BAD_MESSAGE,
            "temperature",
        ),
        (_frame({"type": "welcome", "limits": {}}), ErrorCode.BAD_MESSAGE, "allowed_modes"),
        (msgpack.packb({"type": "cancel", 1: 2}), ErrorCode.BAD_FRAME, "frame"),  # non-string key
        (b"\x82\xa4type\xa6cancel\xa4type\xa6cancel", ErrorCode.BAD_FRAME, "frame"),  # duplicate key
        (msgpack.packb({"type": msgpack.ExtType(1, b"x")}), ErrorCode.BAD_FRAME, "frame"),
        (b"\x91" * 5000, ErrorCode.BAD_FRAME, "frame"),  # deep nesting
    ],
)
def test_malformed_frames_name_the_field(frame: bytes, code: ErrorCode, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code is code, info.value
    assert info.value.field == field
    assert info.value.fatal


def test_size_limits() -> None:
    lim = WireLimits(max_bytes=200, max_nodes=8)
    big = encode(Tree(round=1, tree=TokenTree.build(list(range(100)), [-1] * 100, base=1)))
    with pytest.raises(ProtocolError) as info:
        decode(big, lim)
    assert info.value.code is ErrorCode.TOO_LARGE and info.value.close_code == 1009
    nine = encode(Tree(round=1, tree=TokenTree.build(list(range(9)), [-1] * 9, base=1)))
    with pytest.raises(ProtocolError) as info:
        decode(nine, lim)
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED and info.value.field == "tokens"
    with pytest.raises(ProtocolError):
        decode(cast(Any, "text frame"))


def test_vocab_fingerprint_matches_its_definition() -> None:
    toks = ["<s>", "a", "é", "\u2581the"]
    h = hashlib.sha256(struct.pack("<I", 4))
    for t in toks:
        b = t.encode()
        h.update(struct.pack("<I", len(b)) + b)
    assert vocab_fingerprint(toks) == h.hexdigest()
    assert vocab_fingerprint(toks) != vocab_fingerprint([*toks[:3], "the"])
    assert vocab_fingerprint([t.encode() for t in toks]) == h.hexdigest()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=50),
    st.sampled_from(list(Mode)),
    st.floats(0, 10),
    st.integers(0, 1000),
    st.floats(1e-3, 1.0),
    st.integers(0, 2**63 - 1),
    st.booleans(),
)
def test_prompt_codec_property(
    tokens: list[int], mode: Mode, temp: float, k: int, p: float, seed: int, cont: bool
) -> None:
    msg = Prompt(
        tokens=np.array(tokens), mode=mode, temperature=temp, top_k=k, top_p=p, seed=seed, continue_=cont
    )
    assert _same(decode(encode(msg)), msg)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(-1, 2**31 - 1), max_size=64), st.integers(1, 2**31 - 1), st.integers(0, 2**31 - 1)
)
def test_tree_codec_property(tokens: list[int], rnd: int, base: int) -> None:
    parents = [-1 + (i % 3) * 0 for i in range(len(tokens))]
    msg = Tree(round=rnd, tree=TokenTree.build(tokens, parents, base=base, cond=tokens[:3]))
    assert _same(decode(encode(msg)), msg)
