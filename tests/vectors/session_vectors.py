"""sessions.json: short sessions against a fresh ServerProtocol, with what it sends after each step."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from shared.messages import (
    FEATURES,
    Cancel,
    Hello,
    Message,
    Mode,
    Prompt,
    SessionLimits,
    Stream,
    Tree,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.protocol import ServerProtocol, VerifyTree
from shared.tree import TokenTree
from tests.vectors.vector_wire import FP, LIMITS, VOCAB, meaning


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
