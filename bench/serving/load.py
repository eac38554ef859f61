"""N concurrent edge sessions against the cloud verifier: sessions, errors, round latency and tokens/s,
with continuous batching on and off in the same run.

What continuous batching buys (docs/architecture.md §6): each of N clients loops over Spec-Bench
prompts (prompt -> tree rounds until done -> next prompt) with trees from the prompt-lookup
proposer (`bench.serving.proposer`, no draft model, so the clients cost next to nothing and the verifier
is what is measured). Without `--url` the bench starts the service in this process and runs the
same load twice, with the engine packing every ready session into one forward and with one session
per forward (`ServerConfig.batching`), and reports the throughput ratio.

Per run: generations completed ("sessions_completed": prompt -> done), errors, round latency
(client-side, from sending a prompt or tree to receiving its verdict; p50/p99 over every round,
prefill rounds included) and tokens/s (tokens of every verdict received before the deadline, all
clients together, over the run's seconds). With `--url` the bench drives a verifier it did not
start: it cannot switch that server's batching, so those runs have `"batching": null` and no
speedup. Server and clients share this process's CPUs (nothing is pinned; the table says so).

`--cloud-cost` runs the other bench of this name instead, bench.serving.load_cost, with its own flags.

    python -m bench load --clients 1,4,16 --seconds 30 --json out.json
    python -m bench load --cloud-cost --help
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import add_common_args, positive_ints
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result
from bench.serving.load_clients import (
    PROMPTS,
    BenchError,
    LoadSpec,
    drive,
    load_prompts,
    load_tokenizer,
)
from bench.serving.load_figures import OtherCpu, Tally, render_table, speedups, summarize
from bench.serving.proposer import LookupConfig
from cloud_verifier.server import ThreadedServer
from cloud_verifier.server_config import ServerConfig
from shared.model import Target, load_target
from shared.vocab import vocab_fingerprint


# --------------------------------------------------------------------------------------- server
class InProcessServer(ThreadedServer):
    """The real service in a daemon thread serving an already-loaded target, so several runs
    (batched, unbatched) share one model load; its engine counts the forwards."""

    def __init__(self, config: ServerConfig, target: Target) -> None:
        # open access is what a loopback bench server wants: not worth a warning per run
        logging.getLogger("cloud_verifier.auth").setLevel(logging.ERROR)
        super().__init__(config, target)

    def __enter__(self) -> InProcessServer:
        try:
            self.start(timeout=120)
        except RuntimeError as exc:
            raise BenchError(str(exc)) from exc
        return self

    def forwards(self) -> int:
        engine = self.state.engine
        return int(engine.forwards) if engine is not None else 0


# --------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    return runner.build_parser(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument(
        "--clients",
        type=positive_ints,
        default=[4],
        help="concurrent sessions; a comma list (1,4,16) runs each",
    )
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds per run")
    add_model_args(
        p,
        model="tiny",
        model_help="target alias or path for the in-process server; with --url, only the tokenizer "
        "the prompts are encoded with (must be the server's model's)",
        threads=0,
        threads_help="in-process server: torch threads (0: torch's default)",
    )
    p.add_argument(
        "--url",
        default=None,
        help="drive an existing verifier (ws://host:port/v1/session) instead of starting one; "
        "then no unbatched run is possible",
    )
    p.add_argument(
        "--api-key", default=None, help="API key sent in hello (for --url servers with a key file)"
    )
    add_common_args(
        p,
        json=True,
        json_help="rows: one per run (also as runs)",
        seed=0,
        seed_help="the prompt order",
        tokens=64,
        tokens_help="max_new_tokens of each generation",
        no_progress=True,
    )
    p.add_argument("--nodes", type=int, default=12, help="tree nodes per round (chain + second branch)")
    p.add_argument("--depth", type=int, default=8, help="longest branch of a tree")
    p.add_argument("--ngram", type=int, default=3, help="longest context suffix the proposer looks up")
    p.add_argument("--prompts", type=int, default=0, help="use this many prompts (0: all that fit)")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=1024,
        help="skip prompts longer than this many tokens (chat template included)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="seconds of unrecorded single-client load first (weight packing, allocator); 0: none",
    )
    _server_args(p, d)
    p.add_argument("--prompt-dir", type=Path, default=PROMPTS, help="folder holding spec_bench_dev.jsonl")
    p.add_argument(
        "--cloud-cost",
        action="store_true",
        help="instead: the cloud's cost per token, M real-pair edge clients (recorded, replayed as "
        "separate devices) against M cloud-only ar clients (bench.serving.load_cost; its own flags: "
        "python -m bench load --cloud-cost --help)",
    )


def _server_args(p: argparse.ArgumentParser, d: ServerConfig) -> None:
    """The in-process server's flags (defaults: ServerConfig's)."""
    p.add_argument(
        "--token-budget",
        type=int,
        default=d.token_budget,
        help="in-process server: rows packed into one engine step (longer prefills are chunked)",
    )
    p.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="in-process server: weights and activations dtype",
    )
    p.add_argument("--device", default=d.device, help="in-process server: auto, cpu or cuda[:N]")
    p.add_argument(
        "--no-unbatched",
        action="store_true",
        help="in-process server: skip the unbatched comparison runs (halves the time)",
    )


def server_config(
    args: argparse.Namespace, clients: int, longest_prompt: int, batching: bool
) -> ServerConfig:
    """Room for every client's longest generation and tree; no cost curve (the bench needs none)."""
    return ServerConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_sessions=clients + 2,
        max_nodes=max(64, args.nodes),
        max_depth=max(16, args.depth),
        max_context=longest_prompt + args.tokens + 64,
        token_budget=args.token_budget,
        batching=batching,
        threads=args.threads,
        measure_cost=False,
        log_level="warning",
    )


def cpu_note(target: Target | None) -> str:
    import torch

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    where = f"device {target.device}" if target is not None else "external server"
    return (
        f"no pinning; clients and server share this process's {len(cpus)} CPUs {cpus}, "
        f"torch threads {torch.get_num_threads()}, {where}"
    )


def run(args: argparse.Namespace) -> Result:
    lookup = LookupConfig(nodes=args.nodes, depth=args.depth, max_ngram=args.ngram)
    target: Target | None = None
    if args.url is None:
        target = load_target(args.model, args.dtype, args.device)
        tokenizer = target.tokenizer
        fingerprint = target.vocab_fingerprint
    else:
        tokenizer = load_tokenizer(args.model)
        fingerprint = vocab_fingerprint(tokenizer.token_texts())
    prompts = load_prompts(tokenizer, args.prompt_dir, args.prompts, args.max_prompt_tokens, args.seed)
    longest = max(len(p) for p in prompts)
    spec = LoadSpec(fingerprint=fingerprint, lookup=lookup, tokens=args.tokens, api_key=args.api_key)
    plan = [(n, b) for n in args.clients for b in ([True] if args.no_unbatched else [True, False])]
    progress = not args.no_progress

    def one_run(clients: int, batching: bool | None, seconds: float, label: str) -> tuple[Tally, int | None]:
        if target is None:
            return asyncio.run(drive(args.url, spec, prompts, clients, seconds, label, progress=progress))
        assert batching is not None
        with InProcessServer(server_config(args, clients, longest, batching), target) as srv:
            return asyncio.run(drive(srv.url, spec, prompts, clients, seconds, label, srv.forwards, progress))

    print(f"{len(prompts)} prompts (longest {longest} tokens); cpu: {cpu_note(target)}", flush=True)
    if args.warmup > 0:
        one_run(1, True if target is not None else None, args.warmup, "warm-up")
    runs = []
    for clients, batching in plan if target is not None else [(n, None) for n in args.clients]:
        meter = OtherCpu()
        name = {True: "batched", False: "unbatched", None: "server"}[batching]
        tally, forwards = one_run(clients, batching, args.seconds, f"{clients} clients, {name}")
        runs.append(summarize(clients, batching, args.seconds, tally, forwards, meter.cores()))
    result: dict[str, Any] = {
        "runs": runs,
        "batching_speedup": speedups(runs),
        "model": target.model_id if target is not None else args.model,
        "server": "in-process server" if target is not None else args.url,
        "seconds": args.seconds,
        "tokens": args.tokens,
        "nodes": args.nodes,
        "depth": args.depth,
        "token_budget": args.token_budget if target is not None else None,
        "prompts": len(prompts),
        "cpu": cpu_note(target),
        "round_ms": "client-side, from sending a prompt or tree to its verdict; every round counts",
    }
    return Result(runs, render_table(result), extra=result)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cloud-cost" in argv:  # the other bench of this name: its own flags (bench.serving.load_cost)
        from bench.serving import load_cost

        return load_cost.main([x for x in argv if x != "--cloud-cost"])
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
