"""Configuration of the verifier service: one frozen dataclass, the CLI takes its defaults from it.

Environment variables are read in one place, `ServerConfig.from_env`. Every field has one rule
(`field_type`: the parser its flag and its CLOUD_VERIFIER_<FIELD> variable read it with; numbers
finite and in range, names not empty); `ServerConfig.__post_init__` holds a config made in code to
the same rule, and the session limits to the rule clients read the welcome by
(`SessionLimits.check`), so no configuration starts a verifier that serves nobody.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from shared.cli_args import fraction, integer, nonempty, number, seconds
from shared.messages import SessionLimits
from shared.wire import MAX_U31

DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
ATTENTIONS = ("model", "sdpa", "float64", "triton")
WEIGHTS = ("auto", "fp32", "quantized")
OFFLOADS = ("none", "disk", "host")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
# --resident-gb at most: far beyond any machine's memory, and its bytes (int(gb * 1e9)) stay finite
MAX_RESIDENT_GB = 1e15


@dataclass(frozen=True)
class ServerConfig:
    model: str = "qwen2.5-coder-1.5b"  # alias (see shared.model_store; also tiny) or a GGUF / safetensors dir
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on GPU; or float32 / bfloat16 / float16
    attention: str = "model"  # "model" / "sdpa" / "float64", see LlamaModel and `serve --help`
    weights: str = "auto"  # "fp32" (a GGUF dequantized), "quantized" (its blocks; CPU float32 only) or
    # "auto": quantized for a GGUF on a CPU in float32, else fp32 (shared.model.target.resolve_weights)
    device: str = "auto"  # auto: cuda if available, else cpu
    offload: str = "none"  # "none", or stream the layers that do not fit: "disk" / "host" (offload.py)
    resident_gb: float = 0.0  # with offload: GB for the KV pool, then layers and stream buffers
    offload_threads: int = 2  # with offload disk: threads that split each layer's read
    api_key_file: str | None = None  # one key per line: "KEY [trusted]"
    trust_anonymous: bool = False  # development: treat key-less clients as trusted (mss/rrs allowed)
    max_sessions: int = 64  # concurrent sessions and HTTP generations
    max_waiting: int = 64  # HTTP requests waiting for a slot (more: 429 at once)
    queue_wait_s: float = 30.0  # how long an HTTP request waits for a slot before 429
    max_pending: int = 32  # conditional trees kept per session besides the one in flight
    max_pending_bytes: int = 1 << 20  # frame bytes of one session's pending trees together
    max_nodes: int = 64  # tree nodes per round
    max_depth: int = 16
    max_context: int = 4096  # committed tokens per session (prompt + output)
    max_bytes: int = 1 << 20  # one WebSocket frame
    max_draws: int = 256  # mss/rrs: draws in one tree (shared.tree.DrawLimits)
    max_row_draws: int = 32  # mss/rrs: draws at one parent
    max_q_ids: int = 16384  # mss/rrs: token ids in all q rows of a tree
    max_q_row: int = 4096  # mss/rrs: token ids in one q row
    token_budget: int = 512  # rows packed into one engine step (chunked prefill beyond it)
    prefill_chunk: int = 16  # prompt rows a step for one session while others have work (bench.prefill_share)
    batching: bool = True  # False: one session per engine forward (the baseline bench.load compares)
    kv_blocks: int = 0  # 0: automatic (kv_memory_fraction of the memory left once the weights load)
    kv_memory_fraction: float = 0.5  # the automatic KV pool's share of available memory (kv_pool.py)
    block_size: int = 16
    idle_timeout_s: float = 300.0  # no frame from the client and no round of its in the engine
    header_timeout_s: float = 10.0  # an HTTP request's line and headers must arrive within this
    hello_timeout_s: float = 10.0  # a connection must say hello (and be welcomed) within this
    max_handshakes: int = 64  # connections not yet welcomed (they hold no session slot)
    frames_per_s: float = 250.0  # per connection: frames read per second (+1 per 64 KiB), burst 2 s
    drain_timeout_s: float = 30.0  # on SIGTERM: running generations get this long to finish
    allowed_origins: str = ""  # comma-separated Origin values a browser may connect from ("*": any)
    ssl_certfile: str | None = None  # TLS: serve wss:// and https:// with this certificate (PEM)
    ssl_keyfile: str | None = None  # TLS: its private key (PEM)
    ping_interval_s: float = 20.0
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    tensor_parallel: int = 1  # ranks the target is split over (cloud_verifier.parallel); 1: one process
    measure_cost: bool = True  # measure the verify cost curve at start-up (once per machine: cached)
    remeasure_cost: bool = False  # measure it even when a cached curve exists
    log_level: str = "info"
    log_format: str = "text"  # "text" or "json" (one object per line, session id as a field)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in SessionLimits.RANGES:
                why = value_error(f.name, getattr(self, f.name), type(f.default))
                if why is not None:
                    raise ValueError(f"ServerConfig.{f.name}: {why}")
        try:
            self.limits.check()
        except ValueError as exc:
            raise ValueError(f"ServerConfig.{exc}") from None

    @property
    def limits(self) -> SessionLimits:
        """The limits the welcome advertises."""
        return SessionLimits(
            max_nodes=self.max_nodes,
            max_depth=self.max_depth,
            max_pending=self.max_pending,
            max_pending_bytes=self.max_pending_bytes,
            max_bytes=self.max_bytes,
            max_context=self.max_context,
            max_draws=self.max_draws,
            max_row_draws=self.max_row_draws,
            max_q_ids=self.max_q_ids,
            max_q_row=self.max_q_row,
        )

    @classmethod
    def from_env(cls, base: ServerConfig | None = None) -> ServerConfig:
        """Apply CLOUD_VERIFIER_<FIELD> environment variables (e.g. CLOUD_VERIFIER_PORT=9000); a value
        the field's rule refuses is a ValueError naming the variable."""
        cfg = base or cls()
        updates: dict[str, object] = {}
        for f in fields(cls):
            name = f"CLOUD_VERIFIER_{f.name.upper()}"
            raw = os.environ.get(name)
            if raw is None:
                continue
            if isinstance(getattr(cfg, f.name), bool):
                if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ValueError(f"{name}={raw!r}: expected 1/true/yes/on or 0/false/no/off")
                updates[f.name] = raw.lower() in ("1", "true", "yes", "on")
                continue
            try:
                updates[f.name] = field_type(f.name)(raw)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{name}={raw!r}: {exc}") from None
        return replace(cfg, **updates)  # type: ignore[arg-type]


def _count(lo: int) -> Callable[[str], int]:
    return integer(lo, MAX_U31)


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(options)}")
        return text

    return parse


# the rule of each field that is neither a flag without a value nor free text (ServerConfig's)
_FIELD_TYPES: dict[str, Callable[[str], Any]] = {
    "model": nonempty("the model"),
    "host": nonempty("the host"),
    "port": integer(0, 65535),
    "dtype": _choice(DTYPES),
    "attention": _choice(ATTENTIONS),
    "weights": _choice(WEIGHTS),
    "device": nonempty("the device"),
    "offload": _choice(OFFLOADS),
    "resident_gb": number(0.0, MAX_RESIDENT_GB),
    "offload_threads": integer(1, 256),
    "max_sessions": _count(1),
    "max_waiting": _count(0),
    "queue_wait_s": seconds(zero=True),
    **{name: integer(lo, hi) for name, (lo, hi) in SessionLimits.RANGES.items()},
    "token_budget": _count(1),
    "prefill_chunk": _count(1),
    "kv_blocks": _count(0),  # 0: sized automatically
    "kv_memory_fraction": fraction(zero=False),
    "block_size": _count(1),
    "idle_timeout_s": seconds(),
    "header_timeout_s": seconds(),
    "hello_timeout_s": seconds(),
    "max_handshakes": _count(1),
    "frames_per_s": number(0.0, 1e6),  # 0: no limit
    "drain_timeout_s": seconds(zero=True),  # 0: the drain ends at once
    "ping_interval_s": seconds(),
    "threads": integer(0, 4096),  # 0: torch's default
    "tensor_parallel": integer(1, 1024),
    "log_level": _choice(LOG_LEVELS),
    "log_format": _choice(LOG_FORMATS),
}


# a number field without a rule of its own above: at least a finite number of its kind
for _f in fields(ServerConfig):
    if type(_f.default) in (int, float) and _f.name not in _FIELD_TYPES:
        _FIELD_TYPES[_f.name] = integer() if type(_f.default) is int else number()


def field_type(name: str) -> Callable[[str], Any]:
    """The parser of ServerConfig field `name`'s flag and environment variable: its value, or
    argparse.ArgumentTypeError saying what is wrong (free text fields: the text as it is)."""
    return _FIELD_TYPES.get(name, str)


def value_error(name: str, value: object, kind: type) -> str | None:
    """Why `value` breaks field `name`'s rule (the one its flag is parsed by), or None; `kind`: the
    type of the field's values (int, float or str)."""
    parse = _FIELD_TYPES.get(name)
    if parse is None:  # free text, or an optional file
        return None
    took = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, took):
        return f"expected {'a number' if kind is float else kind.__name__}, got {value!r}"
    try:
        parse(repr(value) if isinstance(value, float) else str(value))
    except argparse.ArgumentTypeError as exc:
        return str(exc)
    return None
