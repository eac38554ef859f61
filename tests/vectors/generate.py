"""Write the protocol's test vectors (tests/vectors/*.json) from the Python implementation.

    python -m tests.vectors.generate

frames.json: single frames as hex, each with its decoded meaning (valid) or the error a conforming
decoder raises (code, field, fatal). sessions.json: short sessions against a server: the frames a
client sends, the server application's own frames (welcome, verdicts), and the frames the server
protocol must answer with, in order. PROTOCOL.md explains both formats. The default suite checks the
Python implementation against the committed files (tests/shared/test_vectors.py); regenerate only
when the protocol changes on purpose.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from shared.errors import ErrorCode, ProtocolError
from shared.messages import (
    FEATURE_COST,
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
    SessionLimits,
    Stale,
    Stream,
    Tree,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.protocol import ServerProtocol, VerifyTree
from shared.sparse import SparseDist, SparseRows
from shared.tree import Draws, TokenTree

HERE = Path(__file__).resolve().parent
VOCAB = 1000  # the vectors' vocabulary size
FP = "ab" * 32  # a vocabulary fingerprint (64 hex digits)
LIMITS = SessionLimits(max_nodes=8, max_depth=4, max_pending=2, max_bytes=4096, max_context=64)

# the element type of every integer-array field (raw little-endian bytes on the wire)
ARRAY_FIELDS = {
    "tokens": "<i4",
    "parents": "<i4",
    "cond": "<i4",
    "stop_ids": "<i4",
    "eos_ids": "<i4",
    "accepted_nodes": "<i4",
    "node": "<i4",
    "qrow": "<i4",
    "q_ids": "<i4",
    "q_ptr": "<u4",
    "q_wm1": "<u2",
    "drafter": "u1",
}


def meaning(obj: Any, key: str = "") -> Any:
    """A decoded frame as JSON: bin fields become {"dtype", "values"}, floats stay numbers."""
    if isinstance(obj, dict):
        return {k: meaning(v, k) for k, v in obj.items()}
    if isinstance(obj, bytes):
        dt = ARRAY_FIELDS.get(key)
        if dt is None:
            return {"bytes_hex": obj.hex()}
        return {"dtype": dt, "values": np.frombuffer(obj, dtype=dt).tolist()}
    if isinstance(obj, list):
        return [meaning(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"float": repr(obj)}
    return obj


def valid(name: str, msg: Message, note: str = "") -> dict[str, Any]:
    frame = encode(msg)
    return {
        "name": name,
        "hex": frame.hex(),
        "valid": True,
        "decoded": meaning(msgpack.unpackb(frame)),
        "note": note,
    }


def invalid(name: str, frame: bytes, note: str = "") -> dict[str, Any]:
    try:
        decode(frame, LIMITS_WIRE)
    except ProtocolError as exc:
        return {
            "name": name,
            "hex": frame.hex(),
            "valid": False,
            "error": {"code": exc.code.value, "field": exc.field, "fatal": exc.fatal},
            "note": note,
        }
    raise AssertionError(f"{name}: the decoder accepted it")


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
        valid("welcome", welcome),
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


LIMITS_WIRE = ServerProtocol(vocab_size=VOCAB, limits=LIMITS).wire


# ---------------------------------------------------------------------------------------- sessions
def _session(
    name: str, steps: list[tuple[str, Message | bytes]], note: str = "", limits: SessionLimits = LIMITS
) -> dict[str, Any]:
    """Run steps on a fresh ServerProtocol; record what it sends after each.

    Where the server verifies a tree re-rooted below the committed sequence (PROTOCOL.md section 5:
    greedy and match), the step also records that tree as `verify_tree` (base, cond, tokens,
    parents), the tree a client computes to check the round's verdict."""
    proto = ServerProtocol(vocab_size=VOCAB, limits=limits)
    out = []
    sent_trees: dict[int, TokenTree] = {}

    def rerooted(v: VerifyTree | None) -> dict[str, Any] | None:
        if v is None or v.tree is None or v.round not in sent_trees:
            return None
        t, orig = v.tree, sent_trees[v.round]
        if np.array_equal(t.cond, orig.cond) and np.array_equal(t.tokens, orig.tokens):
            return None
        return {"base": t.base} | {
            k: np.asarray(getattr(t, k)).tolist() for k in ("cond", "tokens", "parents")
        }

    for who, item in steps:
        frame = item if isinstance(item, bytes) else encode(item)
        step: dict[str, Any] = {"from": who, "hex": frame.hex(), "decoded": meaning(msgpack.unpackb(frame))}
        if who == "client":
            if isinstance(item, Tree):
                sent_trees[item.round] = item.tree
            events = proto.receive(frame)
            step["events"] = [type(e).__name__ for e in events]
            verify = [rerooted(e) for e in events if isinstance(e, VerifyTree)]
            if any(verify):
                step["verify_tree"] = verify[0]
        else:  # the server application: welcome after hello, a verdict after verifying a round
            msg = decode(frame)
            if isinstance(msg, Welcome):
                proto.welcome(msg)
            else:
                assert isinstance(msg, Verdict)
                nxt = proto.verdict(msg)
                step["verify_next"] = nxt.round if nxt is not None else None
                if (tree := rerooted(nxt)) is not None:
                    step["verify_tree"] = tree
        sent = proto.data_to_send()
        step["sent"] = [meaning(msgpack.unpackb(f)) for f in sent]
        step["sent_hex"] = [f.hex() for f in sent]
        out.append(step)
    return {"name": name, "note": note, "vocab_size": VOCAB, "limits": limits.to_wire(), "steps": out}


def sessions() -> list[dict[str, Any]]:
    hello = Hello(FP)
    welcome = Welcome("1", "tiny", VOCAB, (2,), (Mode.GREEDY, Mode.MATCH, Mode.AR), LIMITS, {1: 3.0}, FP)
    prompt = Prompt(np.array([10, 11, 12]), Mode.GREEDY, max_new_tokens=8)
    start: list[tuple[str, Message | bytes]] = [
        ("client", hello),
        ("server_app", welcome),
        ("client", prompt),
    ]
    v0 = Verdict(0, np.array([13]), np.array([], np.int32), True, 4)  # the prompt's answer: S = 10 11 12 13
    bytes_limits = dataclasses.replace(LIMITS, max_pending_bytes=150)
    welcome_bytes = dataclasses.replace(welcome, limits=bytes_limits)
    v1_gap = Verdict(1, np.array([14, 15]), np.array([0]), True, 6, gap_ms=37.25)
    streams = Hello(FP, features=FEATURES)
    with_streams: list[tuple[str, Message | bytes]] = [
        ("client", streams),
        ("server_app", welcome),
        ("client", prompt),
        ("server_app", v0),
    ]
    none = np.array([], np.int32)
    fwd, marg = {0: 4.0, 1: 4.5, 4: 5.5}, {0: 1.0, 1: 1.5, 4: 2.5}

    def tok(rnd: int, t: int, length: int, **kw: Any) -> Verdict:
        return Verdict(rnd, np.array([t]), none, True, length, None, 4.0, **kw)

    return [
        _session(
            "a stream round started at once",
            [
                *with_streams,
                ("client", Stream(1, 3)),
                ("server_app", tok(1, 14, 5, forward_ms=fwd, marginal_ms=marg)),
                ("server_app", tok(1, 15, 6, forward_ms=fwd, marginal_ms=marg)),
                ("server_app", tok(1, 16, 7, forward_ms=fwd, marginal_ms=marg)),
            ],
            "nothing in flight: stream 1 starts at once (events VerifyTree); one verdict a token, "
            "streaming true on the first two (verify_next 1: the stream goes on), none on the third "
            "(k = 3 reached); the welcome names the features honoured and every verdict carries "
            "forward_ms and marginal_ms",
        ),
        _session(
            "a waiting stream is the fallback for a miss",
            [
                *with_streams,
                ("client", Tree(1, TokenTree.chain([14, 15], base=4))),
                ("client", Tree(2, TokenTree.chain([17], base=4, cond=[14, 15, 16]))),
                ("client", Stream(3, 2)),
                ("server_app", Verdict(1, np.array([14, 20]), np.array([0]), True, 6)),
                ("server_app", tok(3, 21, 7)),
                ("server_app", tok(3, 22, 8)),
            ],
            "tree 1 in flight, tree 2 (assuming 14 15 16) and stream 3 wait; verdict 1 commits 14 20: "
            "tree 2 goes stale and stream 3 starts (next_round 3), then streams its 2 tokens",
        ),
        _session(
            "a matching pending tree ends the stream",
            [
                *with_streams,
                ("client", Stream(1, 100)),
                ("client", Tree(2, TokenTree.chain([15, 16], base=4, cond=[14]))),
                ("client", Tree(3, TokenTree.chain([9], base=4, cond=[99]))),
                ("server_app", tok(1, 14, 5)),
            ],
            "while stream 1 decodes its first token the client sends trees assuming it is 14 (tree 2) "
            "or 99 (tree 3); the token is 14: tree 3 goes stale, the verdict has no streaming and names "
            "tree 2 in next_round, which the server verifies next",
        ),
        _session(
            "a prompt that streams",
            [
                ("client", streams),
                ("server_app", welcome),
                ("client", dataclasses.replace(prompt, stream=2)),
                ("server_app", Verdict(0, np.array([13]), none, True, 4)),
                ("server_app", Verdict(0, np.array([14]), none, True, 5)),
                ("client", Tree(1, TokenTree.chain([15], base=5))),
            ],
            "prompt.stream 2: round 0 sends the prefill's token (streaming) and one more; then nothing "
            "is in flight and the client's tree is verified at once",
        ),
        _session(
            "a greedy round",
            [
                *start,
                ("server_app", v0),
                ("client", Tree(1, TokenTree.chain([14, 15], base=4))),
                ("server_app", Verdict(1, np.array([14, 15, 16]), np.array([0, 1]), True, 7)),
            ],
            "each tree is answered by one verdict; committed_len grows by len(tokens)",
        ),
        _session(
            "a conditional tree is verified with no round trip",
            [
                *start,
                ("client", Tree(1, TokenTree.chain([14], base=3, cond=[13]))),
                ("client", Tree(2, TokenTree.chain([9], base=3, cond=[99]))),
                ("server_app", v0),
            ],
            "after verdict 0 (S ends in 13) the server verifies round 1 at once (verify_next, next_round) "
            "and round 2, which assumed 99, goes stale",
        ),
        _session(
            "a tree sent during a stream is re-rooted below the streamed token",
            [
                *with_streams,
                ("client", Stream(1, 100)),
                ("client", Tree(2, TokenTree.build([14, 9, 15, 16], [-1, -1, 0, 2], base=4))),
                ("server_app", tok(1, 14, 5)),
                ("server_app", Verdict(2, np.array([15, 16, 17]), np.array([0, 1]), True, 8)),
            ],
            "greedy and match re-root (PROTOCOL.md section 5): while stream 1 decodes the token after "
            "S = 10 11 12 13 the client sends tree 2 drafted below that S (base 4, no cond: 14 -> 15 -> "
            "16 and 9); it stays pending (events none), since a node below row 0 has a child. The "
            "stream's token is 14, which a path of tree 2 spells: the verdict ends the stream and names "
            "tree 2, which the server verifies re-rooted below 14 (cond [14], nodes 15 -> 16 as 0 -> 1, "
            "positions unchanged); verdict 2's accepted_nodes [0, 1] index that subtree",
        ),
        _session(
            "a conditional tree for a shorter outcome is re-rooted after a longer accept",
            [
                *start,
                ("server_app", v0),
                ("client", Tree(1, TokenTree.chain([14, 15, 16], base=4))),
                ("client", Tree(2, TokenTree.chain([16, 17, 18], base=4, cond=[14, 15]))),
                ("server_app", Verdict(1, np.array([14, 15, 16, 17]), np.array([0, 1, 2]), True, 8)),
                ("server_app", Verdict(2, np.array([18, 19]), np.array([0]), True, 10)),
            ],
            "tree 2 was drafted for tree 1's outcome 14 15 (one node accepted, bonus 15); tree 1 accepts "
            "all three and the bonus 17, so S has grown past tree 2's cond along its own path 16 -> 17: "
            "the server verifies tree 2 at once (next_round 2) as its subtree below 17, the one node 18 "
            "(cond [14, 15, 16, 17]); verdict 2's accepted_nodes [0] is that node",
        ),
        _session(
            "a pending tree stays pending while it may re-root; another goes stale at a leaf",
            [
                *with_streams,
                ("client", Stream(1, 100)),
                ("client", Tree(2, TokenTree.chain([14, 15, 16, 17], base=4))),
                ("client", Tree(3, TokenTree.chain([14, 15], base=4))),
                ("server_app", tok(1, 14, 5)),
                ("client", Tree(4, TokenTree.chain([14, 15, 20], base=4))),
                ("server_app", Verdict(3, np.array([15, 20]), np.array([0]), True, 7)),
            ],
            "trees 2 and 3 are drafted below S = 10 11 12 13 during stream 1; its token 14 follows both: "
            "the latest, tree 3, is verified re-rooted (the node 15) and tree 2 stays pending, since "
            "below 14 it still has a node with a child. Tree 4, sent while round 3 is in flight, is "
            "pending too (below 14 its node 15 has a child). Verdict 3 commits 15 20: tree 4's path "
            "14 15 20 ends at a leaf and tree 2 has no node 20 below 15: both go stale (mismatch) and "
            "nothing is in flight",
        ),
        _session(
            "a tree that arrives after the stream ended is re-rooted at once",
            [
                *with_streams,
                ("client", Stream(1, 1)),
                ("server_app", tok(1, 14, 5)),
                ("client", Tree(2, TokenTree.chain([14, 15, 16], base=4))),
            ],
            "stream 1 of one token ends with 14 before tree 2, drafted below S = 10 11 12 13, arrives: "
            "nothing is in flight, and the tree is verified on arrival (events VerifyTree) re-rooted "
            "below 14 (cond [14], nodes 15 -> 16)",
        ),
        _session(
            "a tree of depth 1 sent during a stream is stale at once",
            [
                *with_streams,
                ("client", Stream(1, 100)),
                ("client", Tree(2, TokenTree.build([14, 20], [-1, -1], base=4))),
                ("server_app", tok(1, 14, 5)),
            ],
            "a tree for S = 10 11 12 13 whose nodes have no children: whatever token the stream adds, "
            "its path ends at a leaf, so it can never be verified (stale at once, mismatch) and the "
            "stream goes on",
        ),
        _session(
            "a tree before any prompt",
            [("client", hello), ("server_app", welcome), ("client", Tree(1, TokenTree.chain([1], base=1)))],
            "BAD_ORDER, not fatal",
        ),
        _session("the first frame is not hello", [("client", prompt)], "BAD_ORDER, fatal"),
        _session("an unknown protocol version", [("client", Hello(FP, version=99))], "BAD_VERSION, fatal"),
        _session(
            "round ids must increase",
            [
                *start,
                ("server_app", v0),
                ("client", Tree(5, TokenTree.chain([1], base=4))),
                ("client", Tree(5, TokenTree.chain([1], base=4))),
            ],
            "the second round 5 is refused: BAD_ORDER on field round",
        ),
        _session(
            "too many pending trees",
            [*start, *[("client", Tree(r, TokenTree.chain([1], base=3, cond=[r]))) for r in range(1, 5)]],
            "max_pending is 2 besides the round in flight: the third is refused (TOO_MANY_PENDING)",
        ),
        _session(
            "a tree over the limits",
            [*start, ("server_app", v0), ("client", Tree(1, TokenTree.chain(list(range(1, 6)), base=4)))],
            "depth 5 > max_depth 4: LIMIT_EXCEEDED on tree.parents, the session goes on",
        ),
        _session(
            "cancel ends the generation at the round in flight",
            [*start, ("client", Cancel()), ("server_app", v0)],
            "the prompt's verdict comes back done, reason cancelled",
        ),
        _session(
            "optional fields go to a client that asks for them",
            [
                ("client", Hello(FP, features=FEATURES)),
                ("server_app", welcome_bytes),
                ("client", prompt),
                ("server_app", v0),
                ("client", Tree(1, TokenTree.chain([14], base=4))),
                ("server_app", v1_gap),
            ],
            "the welcome keeps limits.max_pending_bytes and verdict 1 keeps gap_ms (verdict 0 never has one)",
            limits=bytes_limits,
        ),
        _session(
            "and to no other client",
            [
                ("client", hello),
                ("server_app", welcome_bytes),
                ("client", prompt),
                ("server_app", v0),
                ("client", Tree(1, TokenTree.chain([14], base=4))),
                ("server_app", v1_gap),
            ],
            "a hello without features: the welcome is sent without max_pending_bytes and verdict 1 "
            "without gap_ms, as a client of an earlier release expects",
            limits=bytes_limits,
        ),
        _session(
            "pending trees over max_pending_bytes",
            [
                ("client", Hello(FP, features=FEATURES)),
                ("server_app", welcome_bytes),
                ("client", prompt),
                *[("client", Tree(r, TokenTree.chain([1] * 4, base=3, cond=[r]))) for r in range(1, 3)],
            ],
            "max_pending_bytes 150: the first pending tree (an 86-byte frame) is kept, the second would "
            "make 172 bytes: TOO_MANY_PENDING, not fatal",
            limits=bytes_limits,
        ),
    ]


def main() -> None:
    for name, doc in (("frames", frames()), ("sessions", sessions())):
        path = HERE / f"{name}.json"
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path} ({len(doc)} vectors)")


if __name__ == "__main__":
    main()
