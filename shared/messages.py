"""The wire protocol's messages as typed dataclasses, and their msgpack codec (PROTOCOL.md sections
2-3):

- the messages of a generation: `Prompt` and `Tree` from the edge, `Verdict` and `Stale` from the
  cloud, `Error`, `Cancel`, `Close`; a token tree's wire form;
- the codec, `encode` and `decode`, over every message.

The protocol version, the message types (`MsgType`), the verification modes (`Mode`) and the
handshake (`Hello`, `Welcome`, `SessionLimits`, the `hello.features` names) are in shared.handshake;
this module re-exports them, so that every message is importable from here.

Every frame is one msgpack map with a `type` key. Integer arrays travel as raw little-endian bytes
(msgpack bin): token ids, parents and pointers as int32/uint32, q weights as uint16 holding
`weight - 1`, drafter ids as uint8. Decoding enforces explicit size limits, accepts no extension
types, no duplicate or unknown keys and no non-string keys, and never unpickles anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from shared.errors import ErrorCode, ProtocolError
from shared.handshake import (
    FEATURE_COST,
    FEATURE_DIRECT,
    FEATURE_GAP_MS,
    FEATURE_PENDING_BYTES,
    FEATURE_RESUME,
    FEATURE_STREAM,
    FEATURE_WELCOME_FEATURES,
    FEATURES,
    PROTOCOL_VERSION,
    Hello,
    Mode,
    MsgType,
    SessionLimits,
    Welcome,
    cost_map_to_wire,
    read_cost_map,
)
from shared.sparse import Q_TOTAL, SparseRows
from shared.tree import Draws, TokenTree
from shared.wire import (
    DEFAULT_WIRE_LIMITS,
    MAX_U31,
    MAX_U63,
    FrameStats,
    Reader,
    WireLimits,
    as_ints,
    le_bytes,
    pack_frame,
    unpack_frame,
)

# ---------------------------------------------------------------------------------------------------
# The messages of a generation


def tree_to_wire(tree: TokenTree, d: dict[str, Any]) -> dict[str, Any]:
    d["base"] = tree.base
    d["cond"] = le_bytes(tree.cond)
    d["tokens"] = le_bytes(tree.tokens)
    d["parents"] = le_bytes(tree.parents)
    if tree.draws is not None:
        dr = tree.draws
        d["draws"] = {
            "node": le_bytes(dr.node),
            "drafter": le_bytes(dr.drafter, "u1"),
            "qrow": le_bytes(dr.qrow),
            "q_ptr": le_bytes(dr.q.ptr, "<u4"),
            "q_ids": le_bytes(dr.q.ids),
            "q_wm1": le_bytes(dr.q.weights - 1, "<u2"),  # weight - 1: weights are in [1, 65536]
        }
    return d


def tree_from_wire(r: Reader) -> TokenTree:
    lim = r.limits
    tokens = r.array("tokens", "<i4", lim.max_nodes)
    parents = r.array("parents", "<i4", lim.max_nodes)
    draws = None
    if r.has("draws"):
        dr = r.sub("draws")
        q = SparseRows(
            ptr=dr.array("q_ptr", "<u4", lim.max_q_nnz + 1).astype(np.int64),
            ids=dr.array("q_ids", "<i4", lim.max_q_nnz),
            weights=dr.array("q_wm1", "<u2", lim.max_q_nnz).astype(np.int64) + 1,
        )
        draws = Draws(
            node=dr.array("node", "<i4", lim.max_q_nnz),
            drafter=dr.array("drafter", "u1", lim.max_q_nnz),
            qrow=dr.array("qrow", "<i4", lim.max_q_nnz),
            q=q,
        )
        dr.finish()
    else:
        r.raw("draws", None)
    return TokenTree(
        tokens=tokens,
        parents=parents,
        base=r.integer("base", 0),
        cond=r.array("cond", "<i4", lim.max_tokens),
        draws=draws,
    )


@dataclass(frozen=True)
class Prompt:
    """Client -> server: start a generation (or, with continue_, add a turn to the cached context)."""

    TYPE: ClassVar[MsgType] = MsgType.PROMPT
    tokens: np.ndarray  # [P] int32, the new tokens (the whole prompt, or the next turn if continue_)
    mode: Mode = Mode.GREEDY
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = ()
    continue_: bool = False
    tree: TokenTree | None = None  # optional first tree, verified right after prefill
    # the prompt's answer streams: the prefill's token, then up to stream - 1 more, one forward
    # each, as round 0 (PROTOCOL.md `stream`); 0: not sent. Only with the round.stream feature
    stream: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", as_ints(self.tokens))
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "stop_ids", tuple(int(x) for x in self.stop_ids))

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "tokens": le_bytes(self.tokens),
            "mode": self.mode.value,
            "temperature": float(self.temperature),
            "top_k": self.top_k,
            "top_p": float(self.top_p),
            "seed": self.seed,
            "max_new_tokens": self.max_new_tokens,
            "stop_ids": le_bytes(np.asarray(self.stop_ids, dtype=np.int64)),
            "continue": self.continue_,
        }
        if self.tree is not None:
            d["tree"] = tree_to_wire(self.tree, {})
        if self.stream:
            d["stream"] = self.stream
        return d

    @classmethod
    def from_wire(cls, r: Reader) -> Prompt:
        mode_s = r.text("mode")
        try:
            mode = Mode(mode_s)
        except ValueError as exc:
            raise r.bad("mode", f"unknown mode {mode_s!r}; one of {[m.value for m in Mode]}") from exc
        tree = None
        if r.has("tree"):
            tr = r.sub("tree")
            tree = tree_from_wire(tr)
            tr.finish()
        else:
            r.raw("tree", None)
        return cls(
            tokens=r.array("tokens", "<i4", r.limits.max_tokens),
            mode=mode,
            temperature=r.number("temperature", 0.0, 1e4, 0.0),
            top_k=r.integer("top_k", 0, MAX_U31, 0),
            top_p=r.number("top_p", 1e-9, 1.0, 1.0),
            seed=r.integer("seed", 0, MAX_U63, 0),
            max_new_tokens=r.integer("max_new_tokens", 1, MAX_U31, 128),
            stop_ids=tuple(r.array("stop_ids", "<i4", r.limits.max_list, ()).tolist()),
            continue_=r.flag("continue", False),
            tree=tree,
            stream=r.integer("stream", 1, MAX_U31, None) or 0,
        )


@dataclass(frozen=True)
class Tree:
    """Client -> server: a token tree for round `round` (ids strictly increase within a session)."""

    TYPE: ClassVar[MsgType] = MsgType.TREE
    round: int
    tree: TokenTree

    def to_wire(self) -> dict[str, Any]:
        return tree_to_wire(self.tree, {"round": self.round})

    @classmethod
    def from_wire(cls, r: Reader) -> Tree:
        return cls(round=r.integer("round", 1), tree=tree_from_wire(r))


@dataclass(frozen=True)
class Stream:
    """Client -> server: round `round` streams up to `k` tokens from the target, one forward each,
    at whatever the committed sequence is when it starts (PROTOCOL.md `stream`). Only with the
    round.stream feature."""

    TYPE: ClassVar[MsgType] = MsgType.STREAM
    round: int
    k: int

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round, "k": self.k}

    @classmethod
    def from_wire(cls, r: Reader) -> Stream:
        return cls(round=r.integer("round", 1), k=r.integer("k", 1, MAX_U31))


@dataclass(frozen=True)
class Verdict:
    """Server -> client: the outcome of a round.

    round 0 answers no tree: a prompt sent without one, a token of mode ar, or the end of a
    cancelled generation. tokens = accepted path then the bonus, cut at the first stop id or at
    max_new_tokens. next_round names a pending tree the server is already verifying. gap_ms: the
    ms from the server's previous verdict to the moment it could start verifying this round's tree
    (~0 for a pending tree started at once; after a miss, the edge's drafting and the round trip);
    None for round 0, and on the wire only for a client that asked (hello.features).
    """

    TYPE: ClassVar[MsgType] = MsgType.VERDICT
    round: int
    tokens: np.ndarray  # [k] int32
    accepted_nodes: np.ndarray  # [a] int32 node indices of the verified tree
    has_bonus: bool
    committed_len: int  # length of the committed sequence after this verdict
    next_round: int | None = None
    verify_ms: float = 0.0
    done: bool = False
    reason: str | None = None  # when done: "stop", "length", "context", "cancelled"
    gap_ms: float | None = None
    streaming: bool = False  # a stream round goes on: more verdicts of this round follow
    # what the server expects a next round of this session with N nodes (0: a stream step) to cost:
    # the forward it would run in (forward_ms) and what its rows add to it (marginal_ms); only for
    # a client that asked (hello.features verdict.cost_ms)
    forward_ms: dict[int, float] | None = None
    marginal_ms: dict[int, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", as_ints(self.tokens))
        object.__setattr__(self, "accepted_nodes", as_ints(self.accepted_nodes))

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "round": self.round,
            "tokens": le_bytes(self.tokens),
            "accepted_nodes": le_bytes(self.accepted_nodes),
            "has_bonus": self.has_bonus,
            "committed_len": self.committed_len,
            "verify_ms": float(self.verify_ms),
            "done": self.done,
        }
        if self.next_round is not None:
            d["next_round"] = self.next_round
        if self.reason is not None:
            d["reason"] = self.reason
        if self.gap_ms is not None:
            d["gap_ms"] = float(self.gap_ms)
        if self.streaming:
            d["streaming"] = True
        if self.forward_ms is not None:
            d["forward_ms"] = cost_map_to_wire(self.forward_ms)
        if self.marginal_ms is not None:
            d["marginal_ms"] = cost_map_to_wire(self.marginal_ms)
        return d

    @classmethod
    def from_wire(cls, r: Reader) -> Verdict:
        return cls(
            round=r.integer("round", 0),
            tokens=r.array("tokens", "<i4", r.limits.max_tokens),
            accepted_nodes=r.array("accepted_nodes", "<i4", r.limits.max_nodes),
            has_bonus=r.flag("has_bonus"),
            committed_len=r.integer("committed_len", 0),
            next_round=r.integer("next_round", 1, MAX_U31, None),
            verify_ms=r.number("verify_ms", 0.0, 1e9, 0.0),
            done=r.flag("done"),
            reason=r.text("reason", None),
            gap_ms=r.number("gap_ms", 0.0, 1e9, None),
            streaming=r.flag("streaming", False),
            forward_ms=read_cost_map(r, "forward_ms", None, streams=True),
            marginal_ms=read_cost_map(r, "marginal_ms", None, streams=True),
        )


@dataclass(frozen=True)
class Stale:
    """Server -> client: a tree that will never be verified (it can no longer match)."""

    TYPE: ClassVar[MsgType] = MsgType.STALE
    round: int
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round, "reason": self.reason}

    @classmethod
    def from_wire(cls, r: Reader) -> Stale:
        return cls(round=r.integer("round", 1), reason=r.text("reason"))


@dataclass(frozen=True)
class Error:
    """Either side: what was wrong, which field, and whether the connection ends."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: ErrorCode
    message: str
    field: str | None = None
    fatal: bool = False
    round: int | None = None  # the tree round it refers to (0: the prompt), when it refers to one

    @classmethod
    def from_exception(cls, exc: ProtocolError) -> Error:
        return cls(exc.code, exc.message[:1000], exc.field, exc.fatal, exc.round)

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"code": self.code.value, "message": self.message, "fatal": self.fatal}
        if self.field is not None:
            d["field"] = self.field
        if self.round is not None:
            d["round"] = self.round
        return d

    @classmethod
    def from_wire(cls, r: Reader) -> Error:
        code_s = r.text("code")
        try:
            code = ErrorCode(code_s)
        except ValueError:
            code = ErrorCode.INTERNAL  # a newer peer's code: still an error, still readable
        return cls(
            code=code,
            message=r.text("message"),
            field=r.text("field", None),
            fatal=r.flag("fatal"),
            round=r.integer("round", 0, MAX_U31, None),
        )


@dataclass(frozen=True)
class Cancel:
    """Client -> server: end the current generation (the server answers with a done verdict)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, r: Reader) -> Cancel:
        return cls()


@dataclass(frozen=True)
class Close:
    """Either side: the session ends normally."""

    TYPE: ClassVar[MsgType] = MsgType.CLOSE
    reason: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {} if self.reason is None else {"reason": self.reason}

    @classmethod
    def from_wire(cls, r: Reader) -> Close:
        return cls(reason=r.text("reason", None))


# ---------------------------------------------------------------------------------------------------
# The codec

Message = Hello | Welcome | Prompt | Tree | Stream | Verdict | Stale | Error | Cancel | Close
M = TypeVar("M", bound=Message)

_DECODERS: dict[str, Callable[[Reader], Message]] = {
    MsgType.HELLO.value: Hello.from_wire,
    MsgType.WELCOME.value: Welcome.from_wire,
    MsgType.PROMPT.value: Prompt.from_wire,
    MsgType.TREE.value: Tree.from_wire,
    MsgType.STREAM.value: Stream.from_wire,
    MsgType.VERDICT.value: Verdict.from_wire,
    MsgType.STALE.value: Stale.from_wire,
    MsgType.ERROR.value: Error.from_wire,
    MsgType.CANCEL.value: Cancel.from_wire,
    MsgType.CLOSE.value: Close.from_wire,
}


def encode(msg: Message) -> bytes:
    """One frame: a msgpack map with `type` first."""
    d: dict[str, Any] = {"type": msg.TYPE.value}
    d.update(msg.to_wire())
    return pack_frame(d)


def decode(data: bytes, limits: WireLimits = DEFAULT_WIRE_LIMITS) -> Message:
    """Decode one frame or raise ProtocolError (fatal: the stream can no longer be trusted)."""
    r = Reader(unpack_frame(data, limits), "", limits)
    kind = r.raw("type")
    if not isinstance(kind, str) or kind not in _DECODERS:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {kind!r}; one of {sorted(_DECODERS)}",
            "type",
            fatal=True,
        )
    msg = _DECODERS[kind](r)
    r.finish()
    return msg


__all__ = [
    "DEFAULT_WIRE_LIMITS",
    "FEATURES",
    "FEATURE_COST",
    "FEATURE_DIRECT",
    "FEATURE_GAP_MS",
    "FEATURE_PENDING_BYTES",
    "FEATURE_RESUME",
    "FEATURE_STREAM",
    "FEATURE_WELCOME_FEATURES",
    "PROTOCOL_VERSION",
    "Q_TOTAL",
    "Cancel",
    "Close",
    "Error",
    "FrameStats",
    "Hello",
    "Message",
    "Mode",
    "MsgType",
    "Prompt",
    "SessionLimits",
    "Stale",
    "Stream",
    "Tree",
    "Verdict",
    "Welcome",
    "WireLimits",
    "cost_map_to_wire",
    "decode",
    "encode",
    "read_cost_map",
]
