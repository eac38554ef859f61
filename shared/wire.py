"""The wire layer under the messages: size limits, strict msgpack framing, typed field reading.

Integer arrays travel as raw little-endian bytes (msgpack bin). Unpacking refuses extension types,
duplicate and non-string map keys and anything over the limits, and never unpickles anything;
`Reader` names the field (a dotted path) in every error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from shared.errors import ErrorCode, ProtocolError

MAX_U31 = (1 << 31) - 1
MAX_U63 = (1 << 63) - 1


@dataclass(frozen=True)
class WireLimits:
    """Structural limits applied while decoding a frame, before any semantic check."""

    max_bytes: int = 1 << 20  # one frame
    max_nodes: int = 4096  # tree.tokens, tree.parents, verdict.accepted_nodes
    max_tokens: int = 1 << 17  # prompt.tokens, verdict.tokens, cond
    max_q_nnz: int = 1 << 20  # non-zeros of all q rows of one tree
    max_list: int = 256  # eos_ids, stop_ids, allowed_modes, verify_cost_ms entries
    max_str: int = 4096  # any string


DEFAULT_WIRE_LIMITS = WireLimits()


def as_ints(a: Sequence[int] | np.ndarray, dtype: type = np.int32) -> np.ndarray:
    """A contiguous integer array (int32 by default) from a list or array."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.int64).astype(dtype))


class Reader:
    """Typed access to one decoded msgpack map; every error names `prefix.key`."""

    def __init__(self, m: Any, prefix: str, limits: WireLimits) -> None:
        if not isinstance(m, dict):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "expected a map", prefix or "frame", fatal=True)
        self.m = m
        self.prefix = prefix
        self.limits = limits
        self.used: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def bad(self, key: str, message: str, code: ErrorCode = ErrorCode.BAD_MESSAGE) -> ProtocolError:
        return ProtocolError(code, message, self.name(key), fatal=True)

    def has(self, key: str) -> bool:
        return key in self.m and self.m[key] is not None

    def raw(self, key: str, default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.m or self.m[key] is None:
            if default is ...:
                raise self.bad(key, "missing")
            return default
        return self.m[key]

    def integer(self, key: str, lo: int = 0, hi: int = MAX_U31, default: Any = ...) -> Any:
        v = self.raw(key, default)
        if v is default and default is not ...:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.bad(key, f"must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise self.bad(key, f"must be in [{lo}, {hi}], got {v}")
        return v

    def number(self, key: str, lo: float, hi: float, default: Any = ...) -> Any:
        v = self.raw(key, default)
        if v is default and default is not ...:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.bad(key, f"must be a number, got {type(v).__name__}")
        if not math.isfinite(v) or not lo <= v <= hi:
            raise self.bad(key, f"must be a finite number in [{lo}, {hi}], got {v}")
        return float(v)

    def flag(self, key: str, default: Any = ...) -> Any:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self.bad(key, f"must be a boolean, got {type(v).__name__}")
        return v

    def text(self, key: str, default: Any = ...) -> Any:
        v = self.raw(key, default)
        if v is default and default is not ...:
            return v
        if not isinstance(v, str):
            raise self.bad(key, f"must be a string, got {type(v).__name__}")
        if len(v) > self.limits.max_str:
            raise self.bad(key, f"longer than {self.limits.max_str} characters", ErrorCode.LIMIT_EXCEEDED)
        return v

    def array(self, key: str, dtype: str, max_len: int, default: Any = ...) -> np.ndarray:
        """Raw little-endian integer array; returned in native int32/int64."""
        v = self.raw(key, default)
        if v is default and default is not ...:
            return np.zeros(0, dtype=np.int32) if v is None else as_ints(v)
        if not isinstance(v, bytes):
            raise self.bad(
                key, f"must be raw little-endian {dtype} bytes (msgpack bin), got {type(v).__name__}"
            )
        item = np.dtype(dtype).itemsize
        if len(v) % item:
            raise self.bad(key, f"byte length {len(v)} is not a multiple of {item} ({dtype})")
        if len(v) // item > max_len:
            raise self.bad(
                key, f"{len(v) // item} entries is over the limit of {max_len}", ErrorCode.LIMIT_EXCEEDED
            )
        a = np.frombuffer(v, dtype=dtype)
        return a.astype(np.int64 if dtype in ("<u4", "<i8") else np.int32)

    def str_list(self, key: str, default: Any = ...) -> Any:
        v = self.raw(key, default)
        if v is default and default is not ...:
            return v
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.bad(key, "must be a list of strings")
        if len(v) > self.limits.max_list:
            raise self.bad(key, f"over {self.limits.max_list} entries", ErrorCode.LIMIT_EXCEEDED)
        return v

    def sub(self, key: str) -> Reader:
        return Reader(self.raw(key), self.name(key), self.limits)

    def finish(self) -> None:
        extra = sorted(set(self.m) - self.used)
        if extra:
            raise self.bad(extra[0], "unknown field")


def le_bytes(a: np.ndarray, dtype: str = "<i4") -> bytes:
    """Raw little-endian bytes of an integer array (int32 unless `dtype` says otherwise)."""
    return np.ascontiguousarray(a).astype(dtype).tobytes()


def _pairs_no_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate map key")
    return out


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("msgpack extension types are not accepted")


def unpack_frame(data: bytes, limits: WireLimits) -> dict[str, Any]:
    """One msgpack map from a frame, or ProtocolError (fatal: the stream can no longer be trusted)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(ErrorCode.BAD_FRAME, "frames are binary (msgpack), not text", "frame", fatal=True)
    if len(data) > limits.max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"frame of {len(data)} bytes is over the limit of {limits.max_bytes}",
            "frame",
            fatal=True,
        )
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_pairs_no_duplicates,
            ext_hook=_no_ext,
            max_str_len=limits.max_str,
            max_bin_len=limits.max_bytes,
            max_array_len=limits.max_list,
            max_map_len=64,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types: ExtraData, StackError, ValueError, ...
        # some carry no message (StackError: nested too deeply): name the type then
        why = str(exc) or ("nested too deeply" if type(exc).__name__ == "StackError" else type(exc).__name__)
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"not a valid msgpack frame: {why}", "frame", fatal=True
        ) from exc
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "a frame must be a msgpack map", "frame", fatal=True)
    return obj


def pack_frame(d: dict[str, Any]) -> bytes:
    out: bytes = msgpack.packb(d, use_bin_type=True)
    return out


@dataclass
class FrameStats:
    """Bytes and frames through one protocol object, for per-round accounting."""

    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bytes_by_type_out: dict[str, int] = field(default_factory=dict)
    frames_by_type_out: dict[str, int] = field(default_factory=dict)

    def out(self, kind: str, n: int) -> None:
        self.frames_out += 1
        self.bytes_out += n
        self.bytes_by_type_out[kind] = self.bytes_by_type_out.get(kind, 0) + n
        self.frames_by_type_out[kind] = self.frames_by_type_out.get(kind, 0) + 1

    def inc(self, n: int) -> None:
        self.frames_in += 1
        self.bytes_in += n
