"""`python -m bench.load`: N concurrent edge sessions against the verifier, batched vs unbatched.

What continuous batching buys (issue 5, DESIGN section 6): each of N clients loops over Spec-Bench
prompts (prompt -> tree rounds until done -> next prompt) with trees from the prompt-lookup
proposer (`bench.proposer`, no draft model, so the clients cost next to nothing and the verifier
is what is measured). Without `--url` the bench starts the service in this process and runs the
same load twice, with the engine packing every ready session into one forward and with one session
per forward (`ServerConfig.batching`), and reports the throughput ratio.

Per run: generations completed ("sessions_completed": prompt -> done), errors, round latency
(client-side, from sending a prompt or tree to receiving its verdict; p50/p99 over every round,
prefill rounds included) and tokens/s (tokens of every verdict received before the deadline, all
clients together, over the run's seconds). With `--url` the bench drives a verifier it did not
start: it cannot switch that server's batching, so those runs have `"batching": null` and no
speedup. Server and clients share this process's CPUs (nothing is pinned; the table says so).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.proposer import LookupConfig, propose
from cloud_verifier.config import ServerConfig
from cloud_verifier.model import Target, TargetTokenizer, load_target
from cloud_verifier.server import ThreadedServer
from shared.errors import ErrorCode
from shared.messages import Error, Hello, Mode, Prompt, Stale, Tree, Verdict, Welcome
from shared.protocol import ClientProtocol
from shared.vocab import vocab_fingerprint

PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "prompts"
PROMPT_FILE = "spec_bench_dev.jsonl"
# a refused hello will be refused again: stop the run instead of reconnecting in a loop
FATAL_AT_HELLO = (ErrorCode.VOCAB_MISMATCH, ErrorCode.UNAUTHORIZED, ErrorCode.BAD_VERSION)


class BenchError(RuntimeError):
    """The load cannot run at all (no prompts, a refused hello, a server that never got ready)."""


# --------------------------------------------------------------------------------------- prompts
def load_tokenizer(model: str) -> TargetTokenizer:
    """The tokenizer of `model` without loading its weights (for `--url`, where the server has them)."""
    from cloud_verifier.model import gguf_loader, safetensors_loader
    from shared import model_store

    alias = "smollm2-135m" if model == "tiny" else model
    path = model_store.resolve(alias, "target") if alias in model_store.ALIASES else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_loader.tokenizer_from_gguf(gguf_loader.open_gguf(path), path)
    if path.is_dir():
        return safetensors_loader.tokenizer_from_dir(path, safetensors_loader.config_from_dir(path))
    raise BenchError(f"{model!r} is not an alias, a .gguf file or a model directory")


def load_prompts(
    tokenizer: TargetTokenizer, folder: Path, count: int, max_tokens: int, seed: int
) -> list[list[int]]:
    """First turns of the Spec-Bench dev prompts, chat-templated and encoded, in a seeded order
    (the file is grouped by category; shuffling gives every run the same mix from its start)."""
    path = folder / PROMPT_FILE
    if not path.is_file():
        raise BenchError(f"no prompt file at {path}")
    prompts: list[list[int]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        text = json.loads(line)["turns"][0]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        ids = tokenizer.encode(text)
        if len(ids) <= max_tokens:
            prompts.append(ids)
    if not prompts:
        raise BenchError(f"no prompt in {path} is within {max_tokens} tokens")
    random.Random(seed).shuffle(prompts)
    return prompts[:count] if count > 0 else prompts


class PromptCycle:
    """Hands prompts out in order, round robin over every client of a run (single event loop)."""

    def __init__(self, prompts: Sequence[list[int]]) -> None:
        self.prompts = prompts
        self.i = 0

    def next(self) -> list[int]:
        p = self.prompts[self.i % len(self.prompts)]
        self.i += 1
        return p


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


# --------------------------------------------------------------------------------------- clients
@dataclass(frozen=True)
class LoadSpec:
    """What every client of a run does."""

    fingerprint: str
    lookup: LookupConfig
    tokens: int  # max_new_tokens per generation
    api_key: str | None = None


@dataclass
class Tally:
    """What the clients of one run saw before the deadline."""

    round_ms: list[float] = field(default_factory=list)  # every round, prompt rounds included
    prompt_ms: list[float] = field(default_factory=list)  # round 0: prefill + the attached tree
    tokens: int = 0
    rounds: int = 0
    prompt_tokens: int = 0  # prefill work sent (prompts whose first verdict came in time)
    sessions_completed: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def verdict(self, ms: float, tokens: int, first: int) -> None:
        """first: the prompt's length on its round-0 verdict, else 0."""
        self.round_ms.append(ms)
        if first:
            self.prompt_ms.append(ms)
            self.prompt_tokens += first
        self.tokens += tokens
        self.rounds += 1

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what)


class _RoundFailed(Exception):
    """The server answered a round with an error: count it, reconnect, go on."""


def _frame(data: str | bytes) -> bytes:
    if isinstance(data, str):
        raise _RoundFailed("the server sent a text frame; the protocol is binary")
    return data


async def _connect(url: str, spec: LoadSpec) -> tuple[Any, ClientProtocol]:
    from websockets.asyncio.client import connect

    ws = await connect(url, max_size=None, open_timeout=30)
    proto = ClientProtocol()
    await ws.send(proto.hello(Hello(vocab_fingerprint=spec.fingerprint, api_key=spec.api_key)))
    reply = proto.receive(_frame(await ws.recv()))
    if isinstance(reply, Error) and reply.code in FATAL_AT_HELLO:
        await ws.close()
        raise BenchError(f"the verifier refused the session: {reply.code.value}: {reply.message}")
    if not isinstance(reply, Welcome):
        await ws.close()
        raise _RoundFailed(f"hello answered with {reply}")
    return ws, proto


def _lookup_for(spec: LoadSpec, welcome: Welcome | None) -> LookupConfig:
    """The proposer's tree within the server's advertised limits."""
    cfg = spec.lookup
    if welcome is None:
        return cfg
    lim = welcome.limits
    return replace(cfg, nodes=min(cfg.nodes, lim.max_nodes), depth=min(cfg.depth, lim.max_depth))


async def _generate(
    ws: Any, proto: ClientProtocol, spec: LoadSpec, prompts: PromptCycle, tally: Tally, deadline: float
) -> None:
    """Generations back to back on one connection until the deadline."""
    loop = asyncio.get_running_loop()
    lookup = _lookup_for(spec, proto.welcome_msg)
    while loop.time() < deadline:
        tokens = prompts.next()
        prompt = Prompt(
            tokens=np.asarray(tokens, dtype=np.int32),
            mode=Mode.GREEDY,
            max_new_tokens=spec.tokens,
            tree=propose(tokens, lookup),
        )
        sent = loop.time()
        await ws.send(proto.prompt(prompt))
        first = len(tokens)
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                msg = proto.receive(_frame(await asyncio.wait_for(ws.recv(), left)))
            except TimeoutError:
                return
            if isinstance(msg, Stale):
                continue
            if isinstance(msg, Error):
                raise _RoundFailed(f"{msg.code.value} ({msg.field}): {msg.message}")
            if not isinstance(msg, Verdict):
                raise _RoundFailed(f"unexpected {msg.TYPE.value}")
            tally.verdict((loop.time() - sent) * 1e3, len(msg.tokens), first)
            first = 0
            if msg.done:
                tally.sessions_completed += 1
                break
            tree = propose(proto.committed, lookup)
            sent = loop.time()
            await ws.send(proto.tree(Tree(proto.last_round + 1, tree)))


async def _client(
    url: str,
    spec: LoadSpec,
    prompts: PromptCycle,
    tally: Tally,
    conn: tuple[Any, ClientProtocol] | BaseException,
    deadline: float,
) -> None:
    """One client: its generations until the deadline, reconnecting after any failure."""
    loop = asyncio.get_running_loop()
    while True:
        if isinstance(conn, BenchError):
            raise conn
        if isinstance(conn, BaseException):
            tally.error(f"{type(conn).__name__}: {conn}")
            if loop.time() >= deadline:
                return
            await asyncio.sleep(0.1)  # do not spin on a server that refuses us
            try:
                conn = await _connect(url, spec)
            except Exception as exc:
                conn = exc
            continue
        ws, proto = conn
        try:
            await _generate(ws, proto, spec, prompts, tally, deadline)
            return
        except Exception as exc:  # a failed round or a dropped connection: count it, carry on
            conn = exc
        finally:
            with contextlib.suppress(Exception):
                await ws.close()


async def drive(
    url: str,
    spec: LoadSpec,
    prompts: Sequence[list[int]],
    clients: int,
    seconds: float,
    label: str,
    forwards: Callable[[], int] | None = None,
) -> tuple[Tally, int | None]:
    """Run `clients` concurrent clients for `seconds`; returns the tally and the engine forwards
    in that time (when the bench owns the server)."""
    loop = asyncio.get_running_loop()
    conns = await asyncio.gather(*(_connect(url, spec) for _ in range(clients)), return_exceptions=True)
    for c in conns:
        if isinstance(c, BenchError):
            raise c
    tally = Tally()
    cycle = PromptCycle(prompts)
    f0 = forwards() if forwards else None
    start = loop.time()
    deadline = start + seconds
    with tqdm(
        total=seconds, desc=label, unit="s", bar_format="{desc}: {bar} {n:.0f}/{total:.0f} s{postfix}"
    ) as bar:

        async def progress() -> None:
            while True:
                bar.n = min(loop.time() - start, seconds)
                bar.set_postfix_str(
                    f"{tally.tokens / max(bar.n, 1e-9):.1f} tok/s, {tally.sessions_completed} done, "
                    f"{tally.errors} errors"
                )
                await asyncio.sleep(0.5)

        ticker = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(_client(url, spec, cycle, tally, c, deadline) for c in conns))
        finally:
            ticker.cancel()
        bar.n = seconds
        bar.refresh()
    done_forwards = forwards() - f0 if forwards and f0 is not None else None
    return tally, done_forwards


# --------------------------------------------------------------------------------------- figures
class OtherCpu:
    """CPU time that other processes used during a run, in cores. The machine is shared: a busy
    neighbour during one run of a batched/unbatched pair skews the ratio, and this shows it."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0 = _machine_busy_s()
        self.own0 = _own_cpu_s()

    def cores(self) -> float | None:
        busy = _machine_busy_s()
        if busy is None or self.busy0 is None:
            return None
        others = (busy - self.busy0) - (_own_cpu_s() - self.own0)
        return max(0.0, others) / max(time.monotonic() - self.t0, 1e-9)


def _machine_busy_s() -> float | None:
    """Seconds all CPUs spent busy since boot (Linux /proc/stat; None elsewhere)."""
    try:
        line = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in line[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (no interpolation: p99 of few rounds is an observed round)."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 100)) - 1))
    return ordered[k]


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def summarize(
    clients: int,
    batching: bool | None,
    seconds: float,
    tally: Tally,
    forwards: int | None,
    others: float | None,
) -> dict[str, Any]:
    run: dict[str, Any] = {
        "clients": clients,
        "batching": batching,
        "sessions_completed": tally.sessions_completed,
        "errors": tally.errors,
        "tokens_per_s": round(tally.tokens / seconds, 2),
        "round_ms_p50": _r(percentile(tally.round_ms, 50)),
        "round_ms_p99": _r(percentile(tally.round_ms, 99)),
        "prompt_round_ms_p50": _r(percentile(tally.prompt_ms, 50)),
        "prefill_tokens": tally.prompt_tokens,
        "rounds": tally.rounds,
        "tokens": tally.tokens,
        "tokens_per_round": round(tally.tokens / tally.rounds, 3) if tally.rounds else None,
        "seconds": seconds,
        "engine_forwards": forwards,
        "rounds_per_forward": round(tally.rounds / forwards, 3) if forwards else None,
        "other_cpu_cores": _r(others, 2),
    }
    if tally.error_samples:
        run["error_samples"] = tally.error_samples
    return run


def speedups(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """tokens/s batched / unbatched, per client count that has both runs."""
    out: dict[str, float | None] = {}
    for on in (r for r in runs if r["batching"] is True):
        off = next((r for r in runs if r["clients"] == on["clients"] and r["batching"] is False), None)
        if off is not None:
            ratio = on["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else None
            out[str(on["clients"])] = _r(ratio, 3)
    return out


def _fmt(x: Any, width: int, nd: int = 1) -> str:
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, float):
        return f"{x:>{width}.{nd}f}"
    return f"{x!s:>{width}}"


# (header, run key, decimals) of the printed table
COLUMNS = (
    ("clients", "clients", 0),
    ("batching", "batching", 0),
    ("sessions", "sessions_completed", 0),
    ("errors", "errors", 0),
    ("rounds", "rounds", 0),
    ("tok/round", "tokens_per_round", 2),
    ("tokens/s", "tokens_per_s", 1),
    ("p50 ms", "round_ms_p50", 1),
    ("p99 ms", "round_ms_p99", 1),
    ("prompt p50", "prompt_round_ms_p50", 1),
    ("prefill tok", "prefill_tokens", 0),
    ("rounds/fwd", "rounds_per_forward", 2),
    ("others cpu", "other_cpu_cores", 2),
)


def print_table(result: dict[str, Any]) -> None:
    print(f"\nload: {result['model']} on {result['server']}, {result['seconds']:g} s per run, "
          f"greedy, {result['tokens']} new tokens per generation, prompt-lookup trees of "
          f"<= {result['nodes']} nodes, depth <= {result['depth']}")  # fmt: skip
    print(f"cpu: {result['cpu']}")
    print(" ".join(f"{head:>{max(len(head), 8)}}" for head, _, _ in COLUMNS))
    for r in result["runs"]:
        row = {**r, "batching": {True: "on", False: "off", None: "server"}[r["batching"]]}
        print(" ".join(_fmt(row[key], max(len(head), 8), nd) for head, key, nd in COLUMNS))
    if result["batching_speedup"]:
        ratios = ", ".join(
            f"{c} clients {_fmt(v, 0, 2).strip()}x" for c, v in result["batching_speedup"].items()
        )
        print(f"batching speedup (tokens/s batched / unbatched): {ratios}")
    else:
        print(
            "no unbatched comparison: the bench drove an external verifier (--url); it can switch "
            "batching off only on a server it starts itself (run without --url)"
        )
    for r in result["runs"]:
        for sample in r.get("error_samples", []):
            print(f"  error ({r['clients']} clients, batching {r['batching']}): {sample}")


# --------------------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="python -m bench.load",
        description="Concurrent scripted edge sessions against the cloud verifier: sessions, errors, "
        "round latency and tokens/s, with continuous batching on and off in the same run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--clients", type=_ints, default=[4], help="concurrent sessions; a comma list (1,4,16) runs each"
    )
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds per run")
    p.add_argument(
        "--model",
        default="tiny",
        help="target alias or path for the in-process server; with --url, only the tokenizer "
        "the prompts are encoded with (must be the server's model's)",
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
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--tokens", type=int, default=64, help="max_new_tokens of each generation")
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
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt order")
    p.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="seconds of unrecorded single-client load first (weight packing, allocator); 0: none",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=d.token_budget,
        help="in-process server: rows packed into one engine step (longer prefills are chunked)",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="in-process server: torch threads (0: torch's default)"
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
    p.add_argument("--prompt-dir", type=Path, default=PROMPTS, help="folder holding spec_bench_dev.jsonl")
    return p


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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

    def one_run(clients: int, batching: bool | None, seconds: float, label: str) -> tuple[Tally, int | None]:
        if target is None:
            return asyncio.run(drive(args.url, spec, prompts, clients, seconds, label))
        assert batching is not None
        with InProcessServer(server_config(args, clients, longest, batching), target) as srv:
            return asyncio.run(drive(srv.url, spec, prompts, clients, seconds, label, srv.forwards))

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
    print_table(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
