"""frames.json: single frames, valid (with their meaning) or invalid (with the decoder's error)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from shared.errors import ErrorCode
from shared.messages import (
    FEATURE_COST,
    FEATURE_RESUME,
    FEATURE_STREAM,
    FEATURE_WELCOME_FEATURES,
    FEATURES,
    Cancel,
    Close,
    Error,
    Hello,
    Message,
    Mode,
    Prompt,
    Stale,
    Stream,
    Tree,
    Verdict,
    Welcome,
    encode,
)
from shared.sparse import SparseDist, SparseRows
from shared.tree import Draws, TokenTree
from tests.vectors.vector_wire import FP, LIMITS, VOCAB, invalid, valid


def _packed(d: object) -> bytes:
    return bytes(msgpack.packb(d, use_bin_type=True))


def _with(msg: Message, **over: Any) -> bytes:
    d = msgpack.unpackb(encode(msg))
    for k, v in over.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return _packed(d)


def _q(tokens: list[int], weights: list[int]) -> SparseRows:
    return SparseRows.from_rows([SparseDist.from_weights(tokens, weights)])


def frames() -> list[dict[str, Any]]:
    welcome = Welcome(
        "7", "tiny", VOCAB, (2,), (Mode.GREEDY, Mode.MATCH, Mode.AR), LIMITS, {1: 3.5, 16: 7.25}, FP
    )
    stochastic = TokenTree.build(
        [5, 9],
        [-1, -1],
        base=3,
        draws=Draws(
            np.array([0, 1, 0], np.int32),
            np.zeros(3, np.int32),
            np.zeros(3, np.int32),
            _q([5, 9], [40000, 25536]),
        ),
    )
    out = [
        valid("hello", Hello(FP, api_key="k-1", client="example/1.0")),
        valid(
            "hello with features",
            Hello(FP, features=(*FEATURES, "some.later.feature")),
            "the optional fields the client reads (PROTOCOL.md section 10); a server ignores names it "
            "does not know",
        ),
        valid(
            "hello resuming a dropped session",
            Hello(FP, features=(FEATURE_RESUME,), resume="r7Kq2.Zx3-Vd9_fP0wQeLmN8sTbA1g"),
            "the earlier welcome's resume token: its server may still hold that session's KV cache "
            "(PROTOCOL.md section 3)",
        ),
        valid("welcome", welcome),
        valid(
            "welcome with a resume token",
            dataclasses.replace(welcome, resume="r7Kq2.Zx3-Vd9_fP0wQeLmN8sTbA1g"),
            "sent only to a client whose hello names session.resume",
        ),
        valid(
            "welcome offering the verifier's own address",
            dataclasses.replace(
                welcome, resume="r7Kq2.Zx3-Vd9_fP0wQeLmN8sTbA1g", direct="ws://10.0.0.7:42001/v1/session"
            ),
            "sent only to a client whose hello names session.direct and session.resume: a hello there "
            "naming the token moves the session (PROTOCOL.md section 3)",
        ),
        valid(
            "welcome with max_pending_bytes",
            dataclasses.replace(welcome, limits=dataclasses.replace(LIMITS, max_pending_bytes=300)),
            "sent only to a client whose hello names limits.max_pending_bytes",
        ),
        valid("prompt greedy", Prompt(np.array([1, 2, 3]), Mode.GREEDY, max_new_tokens=16)),
        valid(
            "prompt match with a first tree",
            Prompt(
                np.array([1, 2, 3]),
                Mode.MATCH,
                0.7,
                40,
                0.9,
                12345,
                32,
                (2,),
                tree=TokenTree.chain([4, 5], base=3),
            ),
            "the prompt's tree has no round: it is answered by verdict round 0",
        ),
        valid("tree", Tree(1, TokenTree.build([4, 6, 5], [-1, -1, 0], base=4))),
        valid(
            "conditional tree", Tree(2, TokenTree.chain([8], base=4, cond=[4, 5])), "assumes S[4:] == [4, 5]"
        ),
        valid(
            "stochastic tree (mss)",
            Tree(3, stochastic),
            "3 draws: node 0 drawn twice; q weights sum to 65536",
        ),
        valid("verdict", Verdict(1, np.array([4, 5, 7]), np.array([0, 2]), True, 7, None, 12.5, False)),
        valid(
            "verdict done",
            Verdict(2, np.array([2]), np.array([], np.int32), True, 8, None, 3.0, True, "stop"),
        ),
        valid("verdict with next_round", Verdict(1, np.array([4, 5]), np.array([0]), True, 6, 2, 9.0)),
        valid(
            "verdict with gap_ms",
            Verdict(2, np.array([6]), np.array([], np.int32), True, 7, None, 9.0, gap_ms=41.5),
            "the server waited 41.5 ms for this round's tree; sent only to a client whose hello names "
            "verdict.gap_ms",
        ),
        valid(
            "welcome with features",
            dataclasses.replace(welcome, features=(FEATURE_WELCOME_FEATURES, FEATURE_STREAM, FEATURE_COST)),
            "the features of hello.features the server honours; sent only to a client whose hello names "
            "welcome.features",
        ),
        valid(
            "prompt with stream",
            Prompt(np.array([1, 2, 3]), Mode.GREEDY, max_new_tokens=16, stream=4),
            "the prompt's answer streams: round 0 sends the prefill's token, then up to 3 more, one "
            "verdict each; only where welcome.features names round.stream",
        ),
        valid(
            "stream",
            Stream(4, 8),
            "round 4 streams up to 8 tokens, one forward each, from whatever the committed sequence is "
            "when it starts (at once, or as the fallback for a miss)",
        ),
        valid(
            "verdict of a stream, more to come",
            Verdict(4, np.array([9]), np.array([], np.int32), True, 9, None, 2.5, streaming=True),
            "one token, no accepted nodes, has_bonus true; streaming: more verdicts of round 4 follow",
        ),
        valid(
            "verdict ending a stream for a matching tree",
            Verdict(4, np.array([11]), np.array([], np.int32), True, 10, 5, 2.5),
            "no streaming: round 4 ends here, and pending tree 5 (which assumed 11) is verified next",
        ),
        valid(
            "verdict with cost maps",
            Verdict(
                2,
                np.array([6]),
                np.array([], np.int32),
                True,
                7,
                None,
                9.0,
                forward_ms={0: 4.5, 1: 5.0, 8: 6.25},
                marginal_ms={0: 1.5, 1: 2.0, 8: 3.25},
            ),
            "forward_ms / marginal_ms by node count (0: a stream step), keys in increasing order; sent "
            "only to a client whose hello names verdict.cost_ms",
        ),
        valid("stale", Stale(2, "mismatch")),
        valid(
            "error",
            Error(
                ErrorCode.BAD_TREE, "parents[1] = 1 is not -1 or an earlier node", "tree.parents", False, 3
            ),
        ),
        valid("cancel", Cancel()),
        valid("close", Close("done")),
        # decoding errors: every one is fatal (the stream can no longer be trusted)
        invalid("not msgpack", b"\xc1", "0xc1 is never used in msgpack"),
        invalid("not a map", _packed([1, 2])),
        invalid("trailing bytes", _packed({"type": "cancel"}) + b"\x00"),
        invalid("extension type", b"\x81\xa4type\xd4\x01\x00"),
        invalid("duplicate key", b"\x82\xa4type\xa6cancel\xa4type\xa6cancel"),
        invalid("non-string key", _packed({1: 2})),
        invalid("deep nesting", b"\x91" * 2000 + b"\xc0"),
        invalid("declared length past the frame", b"\x81\xa4type\xdb\xff\xff\xff\xffx"),
        invalid("unknown type", _packed({"type": "launch"})),
        invalid("type missing", _packed({"round": 1})),
        invalid("unknown field", _with(Prompt(np.array([1])), speed=1)),
        invalid("field missing", _with(Prompt(np.array([1])), tokens=None)),
        invalid("array not raw bytes", _with(Prompt(np.array([1])), tokens=[1, 2])),
        invalid("array length not whole int32s", _with(Prompt(np.array([1])), tokens=b"\x01\x02\x03")),
        invalid("unknown mode", _with(Prompt(np.array([1])), mode="turbo")),
        invalid("temperature out of range", _with(Prompt(np.array([1])), temperature=1e5)),
        invalid("temperature not finite", _with(Prompt(np.array([1])), temperature=float("nan"))),
        invalid("top_p zero", _with(Prompt(np.array([1])), top_p=0.0)),
        invalid("seed negative", _with(Prompt(np.array([1])), seed=-1)),
        invalid("max_new_tokens zero", _with(Prompt(np.array([1])), max_new_tokens=0)),
        invalid("boolean as an integer", _with(Prompt(np.array([1])), top_k=True)),
        invalid("round zero", _with(Tree(1, TokenTree.chain([1], base=1)), round=0)),
        invalid("base negative", _with(Tree(1, TokenTree.chain([1], base=1)), base=-1)),
        invalid("string too long", _with(Hello(FP), client="x" * 5000)),
        invalid("features not a list", _with(Hello(FP), features="verdict.gap_ms")),
        invalid("resume token empty", _with(Hello(FP), resume=""), "a resume token is 1 to 128 characters"),
        invalid(
            "welcome direct not a WebSocket URL",
            _with(welcome, direct="http://10.0.0.7/v1/session"),
            "a ws:// or wss:// URL of at most 512 characters",
        ),
        invalid("stream k zero", _with(Stream(1, 4), k=0)),
        invalid("stream round zero", _with(Stream(1, 4), round=0)),
        invalid("stream k missing", _with(Stream(1, 4), k=None)),
        invalid("stream k not an integer", _with(Stream(1, 4), k=2.0)),
        invalid("stream with a tree field", _with(Stream(1, 4), base=3), "a stream has no tree"),
        invalid("prompt stream boolean", _with(Prompt(np.array([1])), stream=True)),
        invalid(
            "streaming not a boolean",
            _with(Verdict(1, np.array([4]), np.array([], np.int32), True, 5), streaming=1),
        ),
        invalid(
            "forward_ms not a map",
            _with(Verdict(1, np.array([4]), np.array([0]), True, 5), forward_ms=[1.0]),
        ),
        invalid(
            "forward_ms of 0 ms",
            _with(Verdict(1, np.array([4]), np.array([0]), True, 5), forward_ms={"0": 0.0}),
        ),
        invalid(
            "marginal_ms negative",
            _with(Verdict(1, np.array([4]), np.array([0]), True, 5), marginal_ms={"1": -2.0}),
        ),
        invalid(
            "marginal_ms key not a node count",
            _with(Verdict(1, np.array([4]), np.array([0]), True, 5), marginal_ms={"-1": 2.0}),
        ),
        invalid(
            "forward_ms not finite",
            _with(Verdict(1, np.array([4]), np.array([0]), True, 5), forward_ms={"0": float("inf")}),
        ),
        invalid("welcome features not a list", _with(welcome, features="round.stream")),
        invalid("gap_ms negative", _with(Verdict(1, np.array([4]), np.array([0]), True, 5), gap_ms=-1.0)),
        invalid("frame over max_bytes", _with(Prompt(np.array([1])), tokens=b"\x01\x00\x00\x00" * 1100)),
        *_unusable_welcomes(welcome),
    ]
    return out


def _unusable_welcomes(welcome: Welcome) -> list[dict[str, Any]]:
    """Welcomes a client refuses: a cost curve that is no forward time (shared.verify_cost) or a
    limit outside SessionLimits.RANGES, so no client sizes trees by a server it cannot use."""
    limits = welcome.limits.to_wire()
    return [
        invalid("verify cost 0 ms", _with(welcome, verify_cost_ms={"1": 0.0})),
        invalid("verify cost negative", _with(welcome, verify_cost_ms={"1": -3.5})),
        invalid("verify cost not finite", _with(welcome, verify_cost_ms={"1": float("nan")})),
        invalid("verify cost past 1e9 ms", _with(welcome, verify_cost_ms={"1": 1e308})),
        invalid("verify cost for 0 nodes", _with(welcome, verify_cost_ms={"0": 3.5})),
        invalid("limits max_nodes 0", _with(welcome, limits={**limits, "max_nodes": 0})),
        invalid("limits max_depth 0", _with(welcome, limits={**limits, "max_depth": 0})),
        invalid("limits max_bytes under 4096", _with(welcome, limits={**limits, "max_bytes": 100})),
        invalid("limits max_context 0", _with(welcome, limits={**limits, "max_context": 0})),
        invalid("limits max_pending negative", _with(welcome, limits={**limits, "max_pending": -1})),
    ]
