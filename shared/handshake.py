"""The protocol's version, message types and verification modes, and its handshake (PROTOCOL.md
sections 2-3 and 10): the client's `Hello`, the server's `Welcome` with the `SessionLimits` it
enforces, and the optional fields a client asks for in `hello.features`; the verifier's cost maps
(node count to forward milliseconds) the welcome and the verdict carry.

shared.messages holds the messages of a generation and the codec, and re-exports every name here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from shared.tree import DrawLimits
from shared.verify_cost import cost_curve_error
from shared.wire import MAX_U31, Reader, le_bytes

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


# The handshake


# Optional fields a server of this release sends only to a client that names them in
# `hello.features` (a decoder of an earlier release refuses unknown fields; PROTOCOL.md section 10).
FEATURE_GAP_MS = "verdict.gap_ms"  # verdict.gap_ms: the server's wait before the round it answers
FEATURE_PENDING_BYTES = "limits.max_pending_bytes"  # welcome.limits.max_pending_bytes
FEATURE_WELCOME_FEATURES = "welcome.features"  # welcome.features: the features the server honours
FEATURE_STREAM = "round.stream"  # the client may send `stream` rounds (and prompt.stream)
FEATURE_COST = "verdict.cost_ms"  # verdict.forward_ms and verdict.marginal_ms
# welcome.resume: the session's resume token; a later hello.resume names it after a drop
FEATURE_RESUME = "session.resume"
# welcome.direct: the address of the verifier that holds the session (a fleet replica's own), where
# the client may move the session (a hello naming its resume token) off the fleet's proxy
FEATURE_DIRECT = "session.direct"
# every feature this release knows, in order
FEATURES = (
    FEATURE_GAP_MS,
    FEATURE_PENDING_BYTES,
    FEATURE_WELCOME_FEATURES,
    FEATURE_STREAM,
    FEATURE_COST,
    FEATURE_RESUME,
    FEATURE_DIRECT,
)
# the longest resume token a hello may carry
MAX_RESUME_TOKEN = 128
# the longest direct address a welcome may carry
MAX_DIRECT_URL = 512
# the HTTP header of a resuming connection's upgrade that names its resume token (a fleet's router
# reads it; Ray Serve's session id header)
SESSION_HEADER = "X-Session-Id"


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
    # the token of the session this one resumes after a drop (the earlier welcome's `resume`): its
    # server may still hold that session's KV cache; None: not sent
    resume: str | None = None

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
        if self.resume is not None:
            d["resume"] = self.resume
        return d

    @classmethod
    def from_wire(cls, r: Reader) -> Hello:
        resume = r.text("resume", None)
        if resume is not None and not 0 < len(resume) <= MAX_RESUME_TOKEN:
            raise r.bad("resume", f"a resume token is 1 to {MAX_RESUME_TOKEN} characters")
        return cls(
            version=r.integer("version", 0, 1 << 16),
            vocab_fingerprint=r.text("vocab_fingerprint"),
            api_key=r.text("api_key", None),
            client=r.text("client", None),
            features=tuple(r.str_list("features", ())),
            resume=resume,
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
    # the token a hello names to resume this session after a drop; None: not sent (sent only to a
    # client whose hello.features names session.resume)
    resume: str | None = None
    # a ws:// or wss:// address of the verifier that holds this session, for a client whose
    # hello.features names session.direct (and session.resume); None: not sent
    direct: str | None = None

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
        if self.resume is not None:
            d["resume"] = self.resume
        if self.direct is not None:
            d["direct"] = self.direct
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
        direct = r.text("direct", None)
        if direct is not None and not (
            0 < len(direct) <= MAX_DIRECT_URL and direct.startswith(("ws://", "wss://"))
        ):
            raise r.bad(
                "direct", f"a direct address is a ws:// or wss:// URL of at most {MAX_DIRECT_URL} characters"
            )
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
            resume=r.text("resume", None),
            direct=direct,
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
