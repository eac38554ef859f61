"""Open-loop serving benchmark of the verifier, cloud-only (ar, its OpenAI HTTP API) and edge clients
(its session WebSocket) on the same arrivals, with vLLM's `benchmark_serving` definitions
(bench.serving.serve_metrics): TTFT, TPOT, ITL, E2EL, throughput, goodput, the verifier's forward
seconds per generated token, its spec-decode acceptance and whether the outputs are ar's, per client
kind and request rate.

Requests arrive on a seeded schedule (`--request-rate`, `--burstiness`; `inf` sends all at once),
at most `--max-concurrency` in flight, whatever the server's pace (open loop). Each client kind of
`--clients` runs the same prompts on the same arrivals, at each rate:

  ar         streaming POST /v1/completions to the verifier: cloud-only decoding
  any other  an edge mode (bench.end_to_end.network's: sequence, tree, tree_prespec, budget_prespec, ...; or
             the SDK's own, e.g. auto): EdgeClient.generate over /v1/session, drafting with
             --draft (bench.serving.serve_clients.edge_kind maps the name through bench.end_to_end.e2e's
             variants)

What the edge side shares: this process and its cores, nothing else. A drafter serves one session
at a time (it is not thread-safe, and pre-speculation keeps its workspace between draft steps), so
each request that may be in flight, min(--num-prompts, --max-concurrency), has an EdgeClient with
a session and a drafter of its own (one drafting thread each); the drafters are loaded once and
lent to each edge kind in turn, whose clients keep their session and what they learned across its
requests and rates. `--rtt-ms` puts a TCP delay proxy process (bench.tools.netproxy) between the measured
requests of every kind and the verifier.

Prompts are Spec-Bench's (a chat turn through the model's chat template) or `--prompt-file`'s, or
with `--prompt-tokens MIN:MAX` long raw prompts made by joining them until the verifier's own
tokenizer (POST /tokenize) counts MIN to MAX tokens. Every prompt is tokenized once before the runs
and sent as token ids, so every kind and rate sends the same tokens.

Per (client, rate): completed and failed requests, TTFT, TPOT, ITL and E2EL (mean, p50, p90, p99),
request and output throughput, goodput (`--goodput`), and from the verifier's /metrics before and
after the run its forward seconds per generated token (`verifier_busy_s_per_token`, from
`specdec_verify_forward_seconds_sum`), its preemptions (`cloud_verifier_preemptions_total`) and
its spec-decode counters (`vllm:spec_decode_num_*`: acceptance rate and mean acceptance length as
vLLM's benchmark reports them); each request's output token ids, and `identical_to_ar`: whether
every output equals ar's for the same prompt (greedy only).
Without `--url` the bench starts a verifier, by default as a `cloud-verifier serve` child process
(not pinned: it shares this machine's cores with the client). With `--fleet` it starts an
autoscaling fleet on a local Ray cluster instead and reads it over the runs (replicas, sessions,
queues): rising rates are then a rising load on one fleet (bench.serving.serve_fleet).

    python -m bench serve --clients ar,tree_prespec --request-rate 1,4,inf --json out.json --plot out.png
    python -m bench serve --fleet --model tiny --clients ar,auto --request-rate 0.5,1,2,4 --fleet-plot f.png
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.harness import (
    BenchPrompt,
    add_common_args,
    load_prompts,
    suite_from_args,
    table,
    write_result,
)
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from bench.serving import serve_fleet
from bench.serving.serve_clients import (
    RequestSpec,
    Run,
    ServeBenchError,
    ar_request,
    auth_headers,
    endpoints,
    kinds,
    message,
    run_all,
    stochastic,
)
from bench.serving.serve_fleet import add_fleet_args, check_fleet_args, server
from bench.serving.serve_metrics import (
    SLO_METRICS,
    RequestResult,
    build_long_prompts,
)
from edge_client.defaults import recommended_tree
from edge_client.drafters.base import DrafterError
from edge_client.drafters.registry import backend_choices
from shared.cli_args import number
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
from shared.tree import ExpansionConfig

SPEC_BENCH_ALL = 240  # every Spec-Bench dev prompt (the pieces of --prompt-tokens)


# --------------------------------------------------------------------------------------- prompts
def prompt_ids(args: argparse.Namespace, base: str) -> list[list[int]]:
    """The run's --num-prompts prompts as token ids, by the verifier's /tokenize: a chat turn
    through its chat template, a raw prompt (HumanEval's, --prompt-tokens') as it is. Fewer
    prompts than requests are used again in order."""
    with httpx.Client(timeout=60.0, headers=auth_headers(args.api_key)) as http:

        def tokenize(body: dict[str, Any]) -> list[int]:
            r = http.post(base + "/tokenize", json=body)
            if r.status_code != 200:
                raise ServeBenchError(
                    f"/tokenize refused a prompt: HTTP {r.status_code}: {message(r.content)}"
                )
            ids: list[int] = r.json()["tokens"]
            return ids

        if args.prompt_tokens is not None:
            lo, hi = args.prompt_tokens
            pieces = [p.text for p in _suite(args, SPEC_BENCH_ALL)]
            try:
                texts = build_long_prompts(
                    pieces, args.num_prompts, lo, hi, args.seed, lambda t: len(tokenize({"prompt": t}))
                )
            except ValueError as exc:
                raise ServeBenchError(f"--prompt-tokens {lo}:{hi}: {exc}") from None
            return [tokenize({"prompt": t}) for t in texts]
        suite = _suite(args, args.num_prompts)
        bodies = [
            {"prompt": p.text} if p.raw else {"messages": [{"role": "user", "content": p.text}]}
            for p in suite
        ]
        return [tokenize(bodies[i % len(bodies)]) for i in range(args.num_prompts)]


def _suite(args: argparse.Namespace, n: int) -> list[BenchPrompt]:
    if args.prompt_file:  # a prompt file it cannot read: the parser's error, as a bad flag
        return suite_from_args(0, n, args.prompt_file)
    return load_prompts(n)


def warm_up(args: argparse.Namespace, base: str, ids: list[int]) -> None:
    """One short request before the runs (not measured): a server that refuses stops the bench."""
    spec = RequestSpec(ids, min(8, args.max_tokens), args.temperature, False)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(600.0), headers=auth_headers(args.api_key)
        ) as http:
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
    return runner.build_parser(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    _client_args(p)
    _traffic_args(p)
    add_common_args(
        p,
        json=True,
        json_help="rows: one per (client, request_rate), with the table's figures in full (each "
        "latency's mean, p50, p90, p99), identical_to_ar (every request's output token ids equal ar's "
        "for the same prompt, over the requests both completed: at the same rate, else ar's first; "
        "null without ar or at temperature > "
        "0), the verifier's spec-decode counter deltas (spec_decode_num_drafts, _draft_tokens, "
        "_accepted_tokens, _accepted_tokens_per_pos) and what vLLM's benchmark makes of them "
        "(acceptance_rate, mean_acceptance_length, acceptance_rate_per_pos; null where nothing was "
        "drafted); besides the rows, output_ids: every run's output token ids by request",
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
        help="a PNG of the latency percentiles (left) and the verifier's forward seconds per generated "
        "token (right) against the rate, a line per client kind",
    )
    _server_args(p)
    add_fleet_args(p)


def _client_args(p: argparse.ArgumentParser) -> None:
    """The client kinds and what the edge kinds draft with."""
    p.add_argument(
        "--clients",
        default="ar",
        metavar="KIND[,KIND...]",
        help="client kinds, a comma list, each run on the same prompts and arrivals: ar (streaming "
        "POST /v1/completions, cloud-only decoding) or an edge mode (an EdgeClient session over the "
        "verifier's WebSocket /v1/session drafting with --draft: bench.end_to_end.network's modes, e.g. "
        "sequence, tree, tree_prespec, budget, budget_prespec, and the SDK's own modes, e.g. greedy "
        "or auto); a wrong name lists them all. Each in-flight edge request has a "
        "session and a drafter of its own (a drafter serves one session at a time); the drafters are "
        "made once and lent to each edge kind in turn",
    )
    p.add_argument(
        "--rtt-ms",
        type=number(0.0),
        default=0.0,
        metavar="MS",
        help="round-trip time of the link: the measured requests of every kind (ar's HTTP and the "
        "edge sessions) go through a TCP delay proxy process (bench.tools.netproxy) adding MS/2 each way; "
        "0: straight to the verifier, no proxy. /metrics, /tokenize and the first ar warm-up never "
        "go through it",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="the edge kinds' draft (alias, GGUF path, or `tiny` with --drafter torch); default: the "
        f"draft paired with --model ({', '.join(f'{t} -> {d}' for t, d in PAIRED_DRAFT.items())})",
    )
    p.add_argument(
        "--drafter",
        default=None,
        choices=backend_choices(),
        help="the edge kinds' draft backend, one thread per drafter (auto: llama.cpp or ONNX, "
        "whichever is faster here, measured once and cached); default: torch for the draft tiny, "
        "else llama_cpp",
    )
    p.add_argument(
        "--tree",
        default=None,
        metavar="K1,K2,...",
        help="the static tree (expansion per depth) of the tree and sequence edge modes; default: the "
        "draft's recommended tree (edge_client.defaults)",
    )


def _traffic_args(p: argparse.ArgumentParser) -> None:
    """The requests: their arrivals, prompts, outputs and the goodput's bounds."""
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
    p.add_argument(
        "--temperature",
        type=number(0.0),
        default=0.0,
        help="sampling temperature (0: greedy; the edge kinds verify greedy, above 0 sample-and-match, "
        "and identical_to_ar is then null: ar's sampling is not seeded)",
    )
    p.add_argument(
        "--goodput",
        type=slo,
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:100 e2el:60000: completed requests that meet "
        "every one, per second",
    )


def _server_args(p: argparse.ArgumentParser) -> None:
    """The verifier driven: --url's, or the one the bench starts."""
    p.add_argument(
        "--url", default=None, help="drive a running verifier (http://host:port) instead of starting one"
    )
    p.add_argument("--api-key", default=None, help="API key for --url servers with a key file (Bearer)")
    add_model_args(
        p,
        model="smollm2-135m",
        model_help="the started verifier's model (alias or path)",
        threads=0,
        threads_help="the started verifier's torch threads (0: torch's default)",
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
    "acc len",
    "same as ar",
    "preempt",
    "goodput",
)


def render_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a table (latencies in ms; acc len: vLLM's mean acceptance length, tokens a
    verified round commits; same as ar: identical_to_ar), then each run's first errors."""
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
            "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
            {True: "yes", False: "NO", None: "-"}[r["identical_to_ar"]],
            r["preemptions"],
            "-" if r["goodput"] is None else r["goodput"],
        ]
        for r in rows
    ]
    errors = [f"{r['client']} @ {r['request_rate']:g}: {e}" for r in rows for e in r["errors"]]
    return "\n".join([table(cells, HEADER), *errors])


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Latency percentiles (left) and the verifier's forward seconds per token (right) by rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.harness import save_figure

    rate_list = sorted({float(r["request_rate"]) for r in rows})
    x = {rate: i for i, rate in enumerate(rate_list)}
    fig, (lat, cost) = plt.subplots(1, 2, figsize=(11, 4))
    for i, client in enumerate(dict.fromkeys(r["client"] for r in rows)):
        mine = sorted((r for r in rows if r["client"] == client), key=lambda r: float(r["request_rate"]))
        xs = [x[float(r["request_rate"])] for r in mine]
        color = f"C{i % 10}"  # a colour per client kind, a line style per metric
        for metric, style in (("ttft", "o-"), ("tpot", "s--"), ("e2el", "^-.")):
            for pct, alpha in (("p50", 1.0), ("p99", 0.4)):
                ys = [r[f"{metric}_ms_{pct}"] for r in mine]
                lat.plot(xs, ys, style, color=color, alpha=alpha, label=f"{client} {metric.upper()} {pct}")
        cost.plot(xs, [r["verifier_busy_s_per_token"] * 1000 for r in mine], "o-", color=color, label=client)
    for ax in (lat, cost):
        ax.set_xticks(range(len(rate_list)), [f"{r:g}" for r in rate_list])
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=7)
    lat.set_yscale("log")
    lat.set_ylabel("latency (ms)")
    cost.set_ylabel("verifier forward ms per generated token")
    save_figure(fig, path, dpi=120)


# --------------------------------------------------------------------------------------- main
PAIRED_DRAFT = {DEFAULT_TARGET: DEFAULT_DRAFT, "smollm2-135m": "smollm2-135m-q4", "tiny": "tiny"}


def check_args(args: argparse.Namespace) -> None:
    """--clients as a list, the edge kinds' draft and tree resolved; a usage error (exit 2, one
    line) for an unknown kind or a combination the edge sessions cannot run."""
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    every = kinds()
    unknown = [c for c in clients if c not in every]
    if unknown or not clients:
        raise UsageError(
            f"--clients: unknown kind {', '.join(unknown) or '(none)'}; available: {', '.join(every)}"
        )
    args.clients = list(dict.fromkeys(clients))
    edge = [c for c in args.clients if c != "ar"]
    if edge and args.ignore_eos:
        raise UsageError(f"--ignore-eos: the edge kinds ({', '.join(edge)}) cannot ignore end-of-text (the "
                         "session protocol has no such field); leave it out or run ar alone")  # fmt: skip
    sampled = [c for c in edge if stochastic(c)]
    if sampled and args.temperature <= 0:
        raise UsageError(f"--clients {', '.join(sampled)}: stochastic verification needs --temperature > 0")
    if edge and args.draft is None:
        if args.model not in PAIRED_DRAFT:
            raise UsageError(
                f"--draft: no draft is paired with --model {args.model}; name one for the edge kinds"
            )
        args.draft = PAIRED_DRAFT[args.model]
    args.drafter = args.drafter or ("torch" if args.draft == "tiny" else "llama_cpp")
    if edge:
        args.tree = args.tree or recommended_tree(args.draft)
        try:
            ExpansionConfig.parse(args.tree)
        except ValueError as exc:
            raise UsageError(f"--tree: {exc}") from None
    args.goodput = dict(args.goodput) if args.goodput else None
    check_fleet_args(args)


def run(args: argparse.Namespace) -> Result:
    check_args(args)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    lengths: list[int] = []
    saved: list[Run] = []

    def outputs(done: Sequence[Run]) -> dict[str, object]:
        """The result's own keys: the prompts' lengths and each request's output token ids."""
        ids = [
            {
                "client": r.row["client"],
                "request_rate": r.row["request_rate"],
                "ids": [x.output_ids for x in r.results],
            }
            for r in done
        ]
        return {"prompt_lengths": lengths, "output_ids": ids}

    def save(done: list[Run]) -> Path | None:
        saved[:] = done
        return write_result(args.json, config, [r.row for r in done], False, **outputs(done))

    try:
        with server(args) as srv:
            base = srv.http
            ids = prompt_ids(args, base)
            lengths[:] = [len(p) for p in ids]
            specs = [RequestSpec(p, args.max_tokens, args.temperature, args.ignore_eos) for p in ids]
            warm_up(args, base, ids[0])
            with endpoints(args, base) as ends:
                runs = run_all(args, ends, specs, save)
    except (ServeBenchError, OSError, httpx.HTTPError, DrafterError) as exc:
        print(f"bench.serving.serve: {exc}", file=sys.stderr)
        # --json keeps the runs that finished, marked incomplete
        return Result([r.row for r in saved], complete=False, extra=outputs(saved), config=config, status=1)
    rows = [r.row for r in runs]
    extra, text = outputs(runs), render_rows(rows)
    if srv.fleet is not None:
        fleet = serve_fleet.results(args, runs, srv.fleet)
        extra.update(fleet)
        text += "\n" + serve_fleet.render(fleet["fleet"])
    return Result(rows, text, extra=extra, config=config, plot=lambda path: plot(rows, path))


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
