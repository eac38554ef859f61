"""The vectors' shared settings (vocabulary, fingerprint, limits) and how a frame is written as a
vector: its meaning as JSON, valid or with the error a conforming decoder raises."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from shared.errors import ProtocolError
from shared.messages import (
    Message,
    SessionLimits,
    decode,
    encode,
)
from shared.protocol import ServerProtocol

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


LIMITS_WIRE = ServerProtocol(vocab_size=VOCAB, limits=LIMITS).wire
