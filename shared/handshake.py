"""The handshake messages (PROTOCOL.md section 3): the client's `Hello`, the server's `Welcome` with
the `SessionLimits` it enforces, and the optional fields a client asks for in `hello.features`
(PROTOCOL.md section 10)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from shared.message_types import PROTOCOL_VERSION, Mode, MsgType
from shared.tree_validation import DrawLimits
from shared.wire import (
    Reader,
    le_bytes,
)

# Optional fields a server of this release sends only to a client that names them in
# `hello.features` (a decoder of an earlier release refuses unknown fields; PROTOCOL.md section 10).
FEATURE_GAP_MS = "verdict.gap_ms"  # verdict.gap_ms: the server's wait before the round it answers
FEATURE_PENDING_BYTES = "limits.max_pending_bytes"  # welcome.limits.max_pending_bytes
FEATURES = (FEATURE_GAP_MS, FEATURE_PENDING_BYTES)  # every feature this release knows, in order


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
        out = cls(
            max_nodes=r.integer("max_nodes", 0),
            max_depth=r.integer("max_depth", 0),
            max_pending=r.integer("max_pending", 0),
            max_bytes=r.integer("max_bytes", 1),
            max_context=r.integer("max_context", 1),
            # optional: a server of an earlier release does not send them
            max_draws=r.integer("max_draws", 1, default=DrawLimits.max_draws),
            max_row_draws=r.integer("max_row_draws", 1, default=DrawLimits.max_row_draws),
            max_q_ids=r.integer("max_q_ids", 1, default=DrawLimits.max_q_ids),
            max_q_row=r.integer("max_q_row", 1, default=DrawLimits.max_q_row),
            # optional: sent only to a client that asked for it (hello.features)
            max_pending_bytes=r.integer("max_pending_bytes", 1, default=None),
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

    def to_wire(self) -> dict[str, Any]:
        return {
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

    @classmethod
    def from_wire(cls, r: Reader) -> Welcome:
        modes = []
        for m in r.str_list("allowed_modes"):
            try:
                modes.append(Mode(m))
            except ValueError as exc:
                raise r.bad("allowed_modes", f"unknown mode {m!r}") from exc
        cost_raw = r.raw("verify_cost_ms")
        if not isinstance(cost_raw, dict) or len(cost_raw) > r.limits.max_list:
            raise r.bad("verify_cost_ms", "must be a map of node count (string) to milliseconds")
        cost: dict[int, float] = {}
        for k, v in cost_raw.items():
            if (
                not (isinstance(k, str) and k.isdigit())
                or isinstance(v, bool)
                or not isinstance(v, (int, float))
            ):
                raise r.bad("verify_cost_ms", "must map decimal node counts to numbers")
            if not math.isfinite(v) or v < 0:
                raise r.bad("verify_cost_ms", "milliseconds must be finite and >= 0")
            cost[int(k)] = float(v)
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
        )
