"""Configuration of the verifier service: one frozen dataclass, the CLI takes its defaults from it.

Environment variables are read in one place, `ServerConfig.from_env`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace


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

    @classmethod
    def from_env(cls, base: ServerConfig | None = None) -> ServerConfig:
        """Apply CLOUD_VERIFIER_<FIELD> environment variables (e.g. CLOUD_VERIFIER_PORT=9000); a value
        of the wrong kind is a ValueError naming the variable."""
        cfg = base or cls()
        updates: dict[str, object] = {}
        for f in fields(cls):
            raw = os.environ.get(f"CLOUD_VERIFIER_{f.name.upper()}")
            if raw is None:
                continue
            default = getattr(cfg, f.name)
            name = f"CLOUD_VERIFIER_{f.name.upper()}"
            if isinstance(default, bool):
                if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ValueError(f"{name}={raw!r}: expected 1/true/yes/on or 0/false/no/off")
                updates[f.name] = raw.lower() in ("1", "true", "yes", "on")
            elif isinstance(default, int | float):
                try:
                    updates[f.name] = type(default)(raw)
                except ValueError:
                    kind = "an integer" if isinstance(default, int) else "a number"
                    raise ValueError(f"{name}={raw!r}: expected {kind}") from None
            else:
                updates[f.name] = raw
        return replace(cfg, **updates)  # type: ignore[arg-type]
