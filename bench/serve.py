"""`python -m bench.serve`: an open-loop serving benchmark over the verifier's OpenAI HTTP API,
with vLLM's `benchmark_serving` definitions (bench.serve_metrics).

Requests arrive on a seeded schedule (`--request-rate`, `--burstiness`; `inf` sends all at once),
at most `--max-concurrency` in flight, whatever the server's pace (open loop). Each client kind of
`--clients` runs the same prompts on the same arrivals, at each rate:

  ar   streaming POST /v1/completions to the verifier: cloud-only decoding

Prompts are Spec-Bench's (a chat turn through the model's chat template) or `--prompt-file`'s, or
with `--prompt-tokens MIN:MAX` long raw prompts made by joining them until the verifier's own
tokenizer (POST /tokenize) counts MIN to MAX tokens. Every prompt is tokenized once before the runs
and sent as token ids, so every kind and rate sends the same tokens.

Per (client, rate): completed and failed requests, TTFT, TPOT, ITL and E2EL (mean, p50, p90, p99),
request and output throughput, goodput (`--goodput`), and from the verifier's /metrics before and
after the run its forward seconds per generated token (`verifier_busy_s_per_token`, from
`specdec_verify_forward_seconds_sum`) and its preemptions (`cloud_verifier_preemptions_total`).
Without `--url` the bench starts a verifier, by default as a `cloud-verifier serve` child process
(not pinned: it shares this machine's cores with the client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.harness import (
    BenchPrompt,
    Verifier,
    add_common_args,
    load_prompts,
    read_metrics,
    suite_from_args,
    table,
    write_result,
)
from bench.serve_metrics import (
    SLO_METRICS,
    RequestResult,
    arrival_times,
    build_long_prompts,
    summarize,
    timing,
)

BUSY = "specdec_verify_forward_seconds_sum"  # seconds of engine forwards, every session's
PREEMPTIONS = "cloud_verifier_preemptions_total"
SPEC_BENCH_ALL = 240  # every Spec-Bench dev prompt (the pieces of --prompt-tokens)


class ServeBenchError(RuntimeError):
    """A run that cannot go on (a server that refuses, a prompt that cannot be built): one line."""


# --------------------------------------------------------------------------------------- clients
@dataclass(frozen=True)
class RequestSpec:
    """What every client kind sends for one request."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool


ClientKind = Callable[[httpx.AsyncClient, str, RequestSpec], Awaitable[RequestResult]]


async def ar_request(http: httpx.AsyncClient, base: str, spec: RequestSpec) -> RequestResult:
    """Kind `ar`: one streaming /v1/completions request (cloud-only decoding). Output tokens are
    the final chunk's usage (stream_options.include_usage), else the text's count by /tokenize."""
    body = {
        "prompt": spec.prompt_ids,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": spec.ignore_eos,
    }
    chunks: list[float] = []
    text: list[str] = []
    used: dict[str, Any] | None = None
    failed = RequestResult(False, len(spec.prompt_ids))
    send = time.perf_counter()
    try:
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                failed.error = f"HTTP {r.status_code}: {_message(await r.aread())}"
                return failed
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    failed.error = f"mid-stream: {_message(line[6:].encode())}"
                    return failed
                piece = (doc.get("choices") or [{}])[0].get("text") or ""
                if piece:
                    chunks.append(time.perf_counter())
                    text.append(piece)
                used = doc.get("usage") or used
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        failed.error = f"{type(exc).__name__}: {exc}"
        return failed
    end = time.perf_counter()
    ttft, itl, latency = timing(send, chunks, end)
    if used is not None:
        n = int(used["completion_tokens"])
    else:
        r2 = await http.post(base + "/tokenize", json={"prompt": "".join(text), "add_special_tokens": False})
        n = int(r2.json()["count"])
    return RequestResult(True, len(spec.prompt_ids), n, ttft, latency, itl)


CLIENTS: dict[str, ClientKind] = {"ar": ar_request}


def _message(raw: bytes) -> str:
    """An error body's message (OpenAI's {"error": {"message"}}), else its text, on one line."""
    try:
        doc = json.loads(raw)
        msg = str(doc["error"]["message"])
    except (ValueError, KeyError, TypeError):
        msg = raw.decode("utf-8", "replace")
    return " ".join(msg.split())[:300]


# --------------------------------------------------------------------------------------- a run
async def run_load(
    kind: ClientKind,
    base: str,
    specs: Sequence[RequestSpec],
    arrivals: Sequence[float],
    max_concurrency: int | None,
    headers: dict[str, str],
    bar: tqdm[Any],
) -> tuple[list[RequestResult], float]:
    """Send specs[i] at arrivals[i] seconds from the start (open loop: whether or not earlier ones
    have answered), at most max_concurrency in flight; the results and the run's seconds."""
    limit = max_concurrency or len(specs)
    gate = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as http:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with gate:
                r = await kind(http, base, specs[i])
            bar.update(1)
            return r

        results = await asyncio.gather(*(one(i) for i in range(len(specs))))
        return list(results), time.perf_counter() - start


def measure(
    args: argparse.Namespace, base: str, client: str, rate: float, specs: Sequence[RequestSpec]
) -> dict[str, object]:
    """One (client, rate) run and its row, with the verifier's cost read from /metrics around it."""
    arrivals = arrival_times(len(specs), rate, args.burstiness, args.seed)
    before = read_metrics(base)
    bar = tqdm(total=len(specs), desc=f"{client} @ {rate:g} req/s", file=sys.stderr, disable=args.no_progress)
    with bar:
        results, duration = asyncio.run(
            run_load(CLIENTS[client], base, specs, arrivals, args.max_concurrency, _headers(args), bar)
        )
    after = read_metrics(base)
    row: dict[str, object] = {
        "client": client,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    row.update(summarize(results, duration, args.goodput))
    busy = after.get(BUSY, 0.0) - before.get(BUSY, 0.0)
    tokens = row["total_output_tokens"]
    assert isinstance(tokens, int)
    row["verifier_busy_s"] = busy
    row["verifier_busy_s_per_token"] = busy / tokens if tokens else math.nan
    row["preemptions"] = int(after.get(PREEMPTIONS, 0.0) - before.get(PREEMPTIONS, 0.0))
    return row


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}


# --------------------------------------------------------------------------------------- prompts
def prompt_ids(ap: argparse.ArgumentParser, args: argparse.Namespace, base: str) -> list[list[int]]:
    """The run's --num-prompts prompts as token ids, by the verifier's /tokenize: a chat turn
    through its chat template, a raw prompt (HumanEval's, --prompt-tokens') as it is. Fewer
    prompts than requests are used again in order."""
    with httpx.Client(timeout=60.0, headers=_headers(args)) as http:

        def tokenize(body: dict[str, Any]) -> list[int]:
            r = http.post(base + "/tokenize", json=body)
            if r.status_code != 200:
                raise ServeBenchError(
                    f"/tokenize refused a prompt: HTTP {r.status_code}: {_message(r.content)}"
                )
            ids: list[int] = r.json()["tokens"]
            return ids

        if args.prompt_tokens is not None:
            lo, hi = args.prompt_tokens
            pieces = [p.text for p in _suite(ap, args, SPEC_BENCH_ALL)]
            try:
                texts = build_long_prompts(
                    pieces, args.num_prompts, lo, hi, args.seed, lambda t: len(tokenize({"prompt": t}))
                )
            except ValueError as exc:
                raise ServeBenchError(f"--prompt-tokens {lo}:{hi}: {exc}") from None
            return [tokenize({"prompt": t}) for t in texts]
        suite = _suite(ap, args, args.num_prompts)
        bodies = [
            {"prompt": p.text} if p.raw else {"messages": [{"role": "user", "content": p.text}]}
            for p in suite
        ]
        return [tokenize(bodies[i % len(bodies)]) for i in range(args.num_prompts)]


def _suite(ap: argparse.ArgumentParser, args: argparse.Namespace, n: int) -> list[BenchPrompt]:
    if args.prompt_file:
        return suite_from_args(ap, 0, n, args.prompt_file)
    return load_prompts(n)


# --------------------------------------------------------------------------------------- the server
@contextmanager
def verifier(args: argparse.Namespace) -> Iterator[str]:
    """The verifier's base URL: --url's, or one started for the runs (a child process, or with
    --in-process a thread of this process serving a target loaded here)."""
    if args.url is not None:
        yield args.url.rstrip("/")
        return
    extra = ["--no-measure-cost", "--max-context", str(args.max_context)]
    if args.kv_blocks:
        extra += ["--kv-blocks", str(args.kv_blocks)]
    if not args.in_process:
        with Verifier(args.model, threads=args.threads, args=extra, echo=not args.no_progress) as v:
            yield v.http
        return
    import logging

    from cloud_verifier.server import ThreadedServer
    from cloud_verifier.server_config import ServerConfig

    logging.getLogger("cloud_verifier.auth").setLevel(logging.ERROR)  # open access on loopback
    config = ServerConfig(
        model=args.model,
        threads=args.threads,
        kv_blocks=args.kv_blocks,
        max_context=args.max_context,
        measure_cost=False,
        log_level="warning",
    )
    server = ThreadedServer(config)
    try:
        server.start(timeout=600)
    except RuntimeError as exc:
        raise ServeBenchError(str(exc)) from None
    try:
        yield server.http
    finally:
        server.stop()


def warm_up(args: argparse.Namespace, base: str, ids: list[int]) -> None:
    """One short request before the runs (not measured): a server that refuses stops the bench."""
    spec = RequestSpec(ids, min(8, args.max_tokens), args.temperature, False)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=_headers(args)) as http:
            return await ar_request(http, base, spec)

    r = asyncio.run(go())
    if not r.ok:
        raise ServeBenchError(f"the warm-up request failed: {r.error}")


# --------------------------------------------------------------------------------------- the flags
def rates(text: str) -> list[float]:
    """An argparse type: a comma list of request rates (requests per second, > 0; `inf`: all at once)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated rates (numbers or inf), got {text!r}"
        ) from None
    if not values or not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected rates > 0 (or inf), got {text!r}")
    return values


def token_range(text: str) -> tuple[int, int]:
    """An argparse type: MIN:MAX tokens, 1 <= MIN <= MAX."""
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX token counts, got {text!r}") from None
    if not sep or not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return a, b


def slo(text: str) -> tuple[str, float]:
    """An argparse type: one SLO, METRIC:MS (ttft, tpot or e2el; milliseconds > 0)."""
    name, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = math.nan
    if name not in SLO_METRICS or not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(
            f"expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, got {text!r}"
        )
    return name, value


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if not v > 0 or math.isinf(v):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Open-loop serving benchmark over the verifier's OpenAI HTTP API (vLLM's "
        "benchmark_serving metrics): TTFT, TPOT, ITL, E2EL, throughput, goodput and the verifier's "
        "forward seconds per generated token, per client kind and request rate.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--clients",
        default="ar",
        help=f"client kinds, a comma list (available: {', '.join(CLIENTS)}); "
        "ar: streaming /v1/completions to the verifier (cloud-only decoding)",
    )
    p.add_argument(
        "--request-rate",
        type=rates,
        default=[math.inf],
        metavar="R[,R...]",
        help="requests per second, one or a comma list (each is a run); inf sends all at once",
    )
    p.add_argument(
        "--burstiness",
        type=positive(float),
        default=1.0,
        metavar="B",
        help="gaps between arrivals are gamma-distributed with shape B, mean 1/rate "
        "(1: Poisson; < 1 burstier; > 1 steadier)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive(int),
        default=None,
        metavar="N",
        help="at most N requests in flight (the rest wait their turn); default: no limit",
    )
    p.add_argument("--num-prompts", type=positive(int), default=24, metavar="N", help="requests per run")
    p.add_argument(
        "--prompt-tokens",
        type=token_range,
        default=None,
        metavar="MIN:MAX",
        help="instead of the prompts as they are: long raw prompts of MIN to MAX tokens (the "
        "verifier's tokenizer), the Spec-Bench dev prompts (or --prompt-file's) joined in a "
        "seeded order",
    )
    p.add_argument(
        "--max-tokens",
        type=positive(int),
        default=256,
        metavar="N",
        help="output tokens per request, at most",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate all --max-tokens tokens (vLLM's ignore_eos: end-of-text does not stop)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--goodput",
        type=slo,
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:100 e2el:60000: completed requests that meet "
        "every one, per second",
    )
    add_common_args(
        p,
        json=True,
        json_help="rows: one per (client, request_rate)",
        seed=0,
        seed_help="the arrival times and --prompt-tokens' prompts",
        prompt_file=True,
        no_progress=True,
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PATH",
        help="a PNG of the latency percentiles and the verifier's cost per token against the rate",
    )
    p.add_argument(
        "--url", default=None, help="drive a running verifier (http://host:port) instead of starting one"
    )
    p.add_argument("--api-key", default=None, help="API key for --url servers with a key file (Bearer)")
    p.add_argument("--model", default="smollm2-135m", help="the started verifier's model (alias or path)")
    p.add_argument(
        "--threads", type=int, default=0, help="the started verifier's torch threads (0: torch's default)"
    )
    p.add_argument(
        "--kv-blocks", type=int, default=0, help="the started verifier's KV pool, in blocks (0: automatic)"
    )
    p.add_argument(
        "--max-context",
        type=positive(int),
        default=4096,
        help="the started verifier's context per generation (prompt + output)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="start the verifier in a thread of this process (shares its GIL) instead of a child process",
    )
    return p


# --------------------------------------------------------------------------------------- output
HEADER = (
    "client",
    "rate",
    "done",
    "failed",
    "req/s",
    "out tok/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "ITL p50",
    "ITL p99",
    "E2EL p50",
    "E2EL p99",
    "busy s/tok",
    "preempt",
    "goodput",
)


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    """The rows as a table (latencies in ms), then each run's first errors."""
    cells = [
        [
            r["client"],
            f"{r['request_rate']:g}",
            r["completed"],
            r["failed"],
            r["request_throughput"],
            r["output_throughput"],
            r["ttft_ms_p50"],
            r["ttft_ms_p99"],
            r["tpot_ms_p50"],
            r["tpot_ms_p99"],
            r["itl_ms_p50"],
            r["itl_ms_p99"],
            r["e2el_ms_p50"],
            r["e2el_ms_p99"],
            f"{r['verifier_busy_s_per_token']:.5f}",
            r["preemptions"],
            "-" if r["goodput"] is None else r["goodput"],
        ]
        for r in rows
    ]
    print(table(cells, HEADER))
    for r in rows:
        for e in r["errors"]:
            print(f"{r['client']} @ {r['request_rate']:g}: {e}")


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Latency percentiles (left) and the verifier's forward seconds per token (right) by rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.harness import save_figure

    rate_list = sorted({float(r["request_rate"]) for r in rows})
    x = {rate: i for i, rate in enumerate(rate_list)}
    fig, (lat, cost) = plt.subplots(1, 2, figsize=(11, 4))
    for client in dict.fromkeys(r["client"] for r in rows):
        mine = sorted((r for r in rows if r["client"] == client), key=lambda r: float(r["request_rate"]))
        xs = [x[float(r["request_rate"])] for r in mine]
        for metric, style in (("ttft", "o-"), ("tpot", "s--"), ("e2el", "^-.")):
            for pct, alpha in (("p50", 1.0), ("p99", 0.5)):
                ys = [r[f"{metric}_ms_{pct}"] for r in mine]
                lat.plot(xs, ys, style, alpha=alpha, label=f"{client} {metric.upper()} {pct}")
        cost.plot(xs, [r["verifier_busy_s_per_token"] * 1000 for r in mine], "o-", label=client)
    for ax in (lat, cost):
        ax.set_xticks(range(len(rate_list)), [f"{r:g}" for r in rate_list])
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=7)
    lat.set_yscale("log")
    lat.set_ylabel("latency (ms)")
    cost.set_ylabel("verifier forward ms per generated token")
    save_figure(fig, path, dpi=120)


# --------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = [c for c in clients if c not in CLIENTS]
    if unknown or not clients:
        ap.error(f"--clients: unknown kind {', '.join(unknown) or '(none)'}; available: {', '.join(CLIENTS)}")
    args.goodput = dict(args.goodput) if args.goodput else None
    rows: list[dict[str, Any]] = []
    try:
        with verifier(args) as base:
            ids = prompt_ids(ap, args, base)
            specs = [RequestSpec(p, args.max_tokens, args.temperature, args.ignore_eos) for p in ids]
            warm_up(args, base, ids[0])
            for client in clients:
                for rate in args.request_rate:
                    rows.append(measure(args, base, client, rate, specs))
                    write_result(args.json, args, rows, False, prompt_lengths=[len(p) for p in ids])
    except (ServeBenchError, OSError, httpx.HTTPError) as exc:
        print(f"bench.serve: {exc}", file=sys.stderr)
        return 1
    print_rows(rows)
    if write_result(args.json, args, rows, True, prompt_lengths=[len(p) for p in ids]) is not None:
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
