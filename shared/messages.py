"""The wire protocol's messages as typed dataclasses, and their msgpack codec (PROTOCOL.md sections
2-3), in one module:

- the protocol version, the message types (`MsgType`) and the verification modes (`Mode`);
- the handshake: the client's `Hello`, the server's `Welcome` with the `SessionLimits` it enforces,
  and the optional fields a client asks for in `hello.features` (PROTOCOL.md section 10);
- the messages of a generation: `Prompt` and `Tree` from the edge, `Verdict` and `Stale` from the
  cloud, `Error`, `Cancel`, `Close`; a token tree's wire form;
- the codec, `encode` and `decode`.

Every frame is one msgpack map with a `type` key. Integer arrays travel as raw little-endian bytes
(msgpack bin): token ids, parents and pointers as int32/uint32, q weights as uint16 holding
`weight - 1`, drafter ids as uint8. Decoding enforces explicit size limits, accepts no extension
types, no duplicate or unknown keys and no non-string keys, and never unpickles anything.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from shared.errors import ErrorCode, ProtocolError
from shared.sparse import Q_TOTAL, SparseRows
from shared.tree import DrawLimits, Draws, TokenTree
from shared.verify_cost import cost_curve_error
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
# The version, the message types and the verification modes

PROTOCOL_VERSION = 1


class MsgType(str, enum.Enum):
    HELLO = "hello"
    WELCOME = "welcome"
    PROMPT = "prompt"
    TREE = "tree"
    VERDICT = "verdict"
    STALE = "stale"
    ERROR = "error"
    CANCEL = "cancel"
    CLOSE = "close"
    STREAM = "stream"


class Mode(str, enum.Enum):
    """Verification modes. `ar` is target-only decoding (the cloud-only baseline)."""

    GREEDY = "greedy"
    MATCH = "match"
    MSS = "mss"
    RRS = "rrs"
    AR = "ar"

    @property
    def stochastic(self) -> bool:
        """Whether trees in this mode carry draws and q rows."""
        return self in (Mode.MSS, Mode.RRS)


# ---------------------------------------------------------------------------------------------------
# The handshake


# Optional fields a server of this release sends only to a client that names them in
# `hello.features` (a decoder of an earlier release refuses unknown fields; PROTOCOL.md section 10).
FEATURE_GAP_MS = "verdict.gap_ms"  # verdict.gap_ms: the server's wait before the round it answers
FEATURE_PENDING_BYTES = "limits.max_pending_bytes"  # welcome.limits.max_pending_bytes
FEATURE_WELCOME_FEATURES = "welcome.features"  # welcome.features: the features the server honours
FEATURE_STREAM = "round.stream"  # the client may send `stream` rounds (and prompt.stream)
FEATURE_COST = "verdict.cost_ms"  # verdict.forward_ms and verdict.marginal_ms
# every feature this release knows, in order
FEATURES = (FEATURE_GAP_MS, FEATURE_PENDING_BYTES, FEATURE_WELCOME_FEATURES, FEATURE_STREAM, FEATURE_COST)


@dataclass(frozen=True)
class Hello:
    """Client -> server, first frame."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    vocab_fingerprint: str
    version: int = PROTOCOL_VERSION
    api_key: str | None = None
    client: str | None = None  # free-form client name/version, for logs
    # optional fields the client reads (FEATURES); names a server does not know are ignored. Empty:
    # not sent, so a hello without features is what a client of an earlier release sends
    features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"version": self.version, "vocab_fingerprint": self.vocab_fingerprint}
        if self.api_key is not None:
            d["api_key"] = self.api_key
        if self.client is not None:
            d["client"] = self.client
        if self.features:
            d["features"] = list(self.features)
        return d

    @classmethod
    def from_wire(cls, r: Reader) -> Hello:
        return cls(
            version=r.integer("version", 0, 1 << 16),
            vocab_fingerprint=r.text("vocab_fingerprint"),
            api_key=r.text("api_key", None),
            client=r.text("client", None),
            features=tuple(r.str_list("features", ())),
        )


@dataclass(frozen=True)
class SessionLimits:
    """What the server advertises in `welcome.limits`.

    max_pending_bytes bounds the frame bytes of one session's pending trees together; None: no bound
    besides max_pending frames of max_bytes (ServerProtocol), and nothing on the wire. A server sends
    it only to a client that asked for it (FEATURE_PENDING_BYTES); a client reads None when the
    server did not send it.
    """

    max_nodes: int = 64
    max_depth: int = 16
    max_pending: int = 32  # room for an outcome cache of ~30 conditional trees a round
    max_bytes: int = 1 << 20
    max_context: int = 4096
    # the work of a stochastic tree's draws (shared.tree.DrawLimits)
    max_draws: int = DrawLimits.max_draws
    max_row_draws: int = DrawLimits.max_row_draws
    max_q_ids: int = DrawLimits.max_q_ids
    max_q_row: int = DrawLimits.max_q_row
    max_pending_bytes: int | None = None

    # The limits a client can work with, (least, most) per field: the one rule `from_wire` reads
    # a welcome by and `check` states for a verifier's own settings, so that no verifier starts
    # with limits every client refuses. A tree needs a node and a depth; a frame must hold a
    # hello and a short prompt; max_pending 0: no conditional trees.
    RANGES: ClassVar[dict[str, tuple[int, int]]] = {
        "max_nodes": (1, MAX_U31),
        "max_depth": (1, MAX_U31),
        "max_pending": (0, MAX_U31),
        "max_bytes": (4096, MAX_U31),
        "max_context": (1, MAX_U31),
        "max_draws": (1, MAX_U31),
        "max_row_draws": (1, MAX_U31),
        "max_q_ids": (1, MAX_U31),
        "max_q_row": (1, MAX_U31),
        "max_pending_bytes": (1, MAX_U31),  # or None: not sent
    }

    def check(self) -> None:
        """Raise ValueError naming the first field outside RANGES."""
        for name, (lo, hi) in self.RANGES.items():
            v = getattr(self, name)
            if v is None and name == "max_pending_bytes":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")

    @property
    def draws(self) -> DrawLimits:
        return DrawLimits(self.max_draws, self.max_row_draws, self.max_q_ids, self.max_q_row)

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "max_nodes": self.max_nodes,
            "max_depth": self.max_depth,
            "max_pending": self.max_pending,
            "max_bytes": self.max_bytes,
            "max_context": self.max_context,
            "max_draws": self.max_draws,
            "max_row_draws": self.max_row_draws,
            "max_q_ids": self.max_q_ids,
            "max_q_row": self.max_q_row,
        }
        if self.max_pending_bytes is not None:
            d["max_pending_bytes"] = self.max_pending_bytes
        return d

    @classmethod
    def from_wire(cls, r: Reader) -> SessionLimits:
        def read(name: str, default: Any = ...) -> Any:
            return r.integer(name, *cls.RANGES[name], default=default)

        out = cls(
            max_nodes=read("max_nodes"),
            max_depth=read("max_depth"),
            max_pending=read("max_pending"),
            max_bytes=read("max_bytes"),
            max_context=read("max_context"),
            # optional: a server of an earlier release does not send them
            max_draws=read("max_draws", DrawLimits.max_draws),
            max_row_draws=read("max_row_draws", DrawLimits.max_row_draws),
            max_q_ids=read("max_q_ids", DrawLimits.max_q_ids),
            max_q_row=read("max_q_row", DrawLimits.max_q_row),
            # optional: sent only to a client that asked for it (hello.features)
            max_pending_bytes=read("max_pending_bytes", None),
        )
        r.finish()
        return out


@dataclass(frozen=True)
class Welcome:
    """Server -> client answer to hello."""

    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    session_id: str
    model_id: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    allowed_modes: tuple[Mode, ...]
    limits: SessionLimits
    verify_cost_ms: dict[int, float]  # forward ms for N tree nodes, measured at start-up
    vocab_fingerprint: str = ""
    version: int = PROTOCOL_VERSION
    # the client's features the server honours; None: not sent (a client that did not ask, or a
    # server of an earlier release)
    features: tuple[str, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        d = {
            "version": self.version,
            "session_id": self.session_id,
            "model_id": self.model_id,
            "vocab_size": self.vocab_size,
            "vocab_fingerprint": self.vocab_fingerprint,
            "eos_ids": le_bytes(np.asarray(self.eos_ids, dtype=np.int64)),
            "allowed_modes": [m.value for m in self.allowed_modes],
            "limits": self.limits.to_wire(),
            # msgpack map keys must be strings (strict_map_key)
            "verify_cost_ms": {str(k): float(v) for k, v in sorted(self.verify_cost_ms.items())},
        }
        if self.features is not None:
            d["features"] = list(self.features)
        return d

    @classmethod
    def from_wire(cls, r: Reader) -> Welcome:
        modes = []
        for m in r.str_list("allowed_modes"):
            try:
                modes.append(Mode(m))
            except ValueError as exc:
                raise r.bad("allowed_modes", f"unknown mode {m!r}") from exc
        cost = read_cost_map(r, "verify_cost_ms")
        features = r.str_list("features", None)
        return cls(
            version=r.integer("version", 0, 1 << 16),
            session_id=r.text("session_id"),
            model_id=r.text("model_id"),
            vocab_size=r.integer("vocab_size", 1),
            vocab_fingerprint=r.text("vocab_fingerprint", ""),
            eos_ids=tuple(r.array("eos_ids", "<i4", r.limits.max_list).tolist()),
            allowed_modes=tuple(modes),
            limits=SessionLimits.from_wire(r.sub("limits")),
            verify_cost_ms=cost,
            features=None if features is None else tuple(features),
        )


def read_cost_map(r: Reader, key: str, default: Any = ..., streams: bool = False) -> Any:
    """A map of node count (decimal string) to forward milliseconds, checked by the rule of
    shared.verify_cost; `streams`: node count 0 (a stream step, row 0 alone) is allowed too."""
    raw = r.raw(key, default)
    if raw is None and default is None:
        return None
    if not isinstance(raw, dict) or len(raw) > r.limits.max_list:
        raise r.bad(key, "must be a map of node count (string) to milliseconds")
    cost: dict[int, float] = {}
    for k, v in raw.items():
        if (
            not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10)
            or isinstance(v, bool)
            or not isinstance(v, (int, float))
        ):
            raise r.bad(key, "must map decimal node counts to numbers")
        cost[int(k)] = float(v)
    if (why := cost_curve_error(cost, allow_zero=streams)) is not None:
        raise r.bad(key, why)
    return cost


def cost_map_to_wire(cost: dict[int, float]) -> dict[str, float]:
    """msgpack map keys must be strings (strict_map_key)."""
    return {str(k): float(v) for k, v in sorted(cost.items())}


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
    "decode",
    "encode",
]
