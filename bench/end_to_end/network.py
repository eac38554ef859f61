"""Latency over a network: ms/token against round-trip time for target-only AR vs sequence vs tree vs
tree + pre-speculation (docs/architecture.md §6).

For every round-trip time, every mode runs the same Spec-Bench prompts, greedy and at temperature
0.7 (sample-and-match). The link is emulated either in the client's process (a delay and
bandwidth shaper in its transport) or, with --proxy, by a TCP delay proxy run as a separate
process between the client and the verifier (real sockets; `tc netem` is not available on these
machines). Verifier and edge are pinned to disjoint cores.

Every row carries where the time goes (bench.end_to_end.network_report.decomposition: V, T_b, p, stall, the
prefill share and the server's gap), from round traces the clients always record; `--trace PATH`
writes those traces, one per generation, for bench.simulation.simulate.

    python -m bench network --proxy --rtt-ms 0,25,50,100 --prompts 20 --tokens 128 \\
        --json bench/out/network.json --plot bench/out/network.png --trace bench/out/network_trace.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from bench.end_to_end.e2e import STOCHASTIC_MODES, run_modes, trusted_key_file
from bench.end_to_end.e2e_results import ModeRuns
from bench.end_to_end.network_report import (
    MODES,
    OPTIONAL,
    decomposition,
    identical_to_ar,
    merge,
    report,
    write_trace,
)
from bench.harness import (
    BenchPrompt,
    CoreSplit,
    Proxy,
    Verifier,
    add_common_args,
    write_result,
)
from bench.lib import runner
from bench.lib.args import add_model_args, suite_from_args
from bench.lib.replay import Recorders, replay_idle
from bench.lib.runner import Result, UsageError
from bench.lib.shaper import LinkShape
from bench.lib.stats import median
from edge_client.client import GenerationResult
from edge_client.defaults import recommended_tree
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import backend_choices, create_drafter
from edge_client.stats import GenerationStats
from shared.messages import Mode
from shared.model.target import resolve_weights
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
from shared.tree import ExpansionConfig


def mode_row(
    mode: str, rtt_ms: float, temperature: float, runs: ModeRuns, gens: Sequence[GenerationStats]
) -> dict[str, Any]:
    """One JSON row: the mode's summary over its generations (`runs`) and where its time went
    (`decomposition` of the same generations' stats)."""
    s = runs.summary()
    prespec = "prespec" in mode or mode.startswith("auto")  # auto pre-speculates too
    row: dict[str, Any] = {
        "rtt_ms": rtt_ms,
        "mode": mode,
        "temperature": temperature,
        "ms_per_token": s["ms_per_token"],
        "tau": s["tau"],
        "hit_rate": s["hit_rate"] if prespec else None,
        "hit_rate_by_depth": s["hit_rate_by_depth"] if prespec else None,
        "predicted_hit_rate": s["predicted_hit_rate"] if prespec else None,
        "target_forwards_per_token": s["target_forwards_per_token"],
        "bytes_up_per_token": s["bytes_up_per_token"],
        "bytes_down_per_token": s["bytes_down_per_token"],
        "draft_ms_per_round": s["draft_ms_per_round"],
        "verify_ms_per_round": s["verify_ms_per_round"],
        "rtt_ms_per_round": s["rtt_ms_per_round"],
        "prespec_draft_ms_per_round": s["prespec_draft_ms_per_round"],
        "prespec_trees_per_round": s["prespec_trees_per_round"],
        "prespec_cancelled_per_round": s["prespec_cancelled_per_round"],
        "prespec_refused_per_round": s["prespec_refused_per_round"],
    }
    d = decomposition(gens)
    row.update(
        {
            "V_ms": d["V_ms"],
            "V_idle_ms": d["V_idle_ms"],
            "identical_to_ar": None,  # main fills it in (network_report.identical_to_ar)
            "V_idle_replay_ms": None,  # run_block's idle replay fills these (--idle-replay)
            "idle_replay_diverged": None,
            "T_b_ms": d["T_b_ms"],
            "p": row["hit_rate"],
            "stall_ms_per_round": d["stall_ms_per_round"],
            "prefill_share_ms_per_token": d["prefill_share_ms_per_token"],
            # ms per token once the prompt is in the cache: where speculation acts
            "decode_ms_per_token": (
                None
                if d["prefill_share_ms_per_token"] is None
                else round(row["ms_per_token"] - d["prefill_share_ms_per_token"], 4)
            ),
            "ttft_ms": d["ttft_ms"],
            "gap_ms": d["gap_ms"],
        }
    )
    return row


def trace_entry(
    mode: str,
    rtt_ms: float,
    temperature: float,
    prompt_index: int,
    stats: GenerationStats,
    tokens: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One generation of the --trace file: its rounds (edge_client.stats.RoundTrace), stats and
    tokens (what network_report.identical_to_ar compares)."""
    return {
        "mode": mode,
        "rtt_ms": rtt_ms,
        "temperature": temperature,
        "prompt_index": prompt_index,
        "trace": stats.trace.as_dict() if stats.trace is not None else None,
        "stats": stats.as_dict(),
        "tokens": None if tokens is None else [int(t) for t in tokens],
    }


async def run_block(
    url: str,
    drafter: Drafter,
    prompts: Sequence[BenchPrompt],
    tokens: int,
    rtt_ms: float,
    temperature: float,
    tree: ExpansionConfig,
    forwards: Callable[[], float],
    modes: Sequence[str],
    link: LinkShape | None = None,
    api_key: str | None = None,
    couple: bool = True,
    progress: bool = True,
    saguaro_c: float = 1.0,
    idle_replay: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every mode on every prompt at one RTT and temperature (bench.end_to_end.e2e.run_modes, traced): the
    rows, and the generations as --trace entries. `idle_replay`: every frame the tree modes sent is
    recorded, and after the block each mode's generations are replayed once with nothing drafting
    (bench.lib.replay.replay_idle): the rows' V_idle_replay_ms and idle_replay_diverged."""
    spec = Mode.GREEDY if temperature == 0 else Mode.MATCH
    gens: dict[str, list[GenerationStats]] = {m: [] for m in modes}
    entries: list[dict[str, Any]] = []
    rec = Recorders(url, api_key) if idle_replay else None

    def taken(mode: str, index: int, gen: GenerationResult) -> None:
        gens[mode].append(gen.stats)
        entries.append(trace_entry(mode, rtt_ms, temperature, index, gen.stats, gen.tokens))
        if rec is not None:
            rec.cut(mode, index)

    runs, _ = await run_modes(
        url,
        drafter,
        prompts,
        tokens,
        temperature,
        spec,
        tree,
        forwards,
        modes=modes,
        progress=progress,
        link=link,
        api_key=api_key,
        couple=couple,
        trace=True,
        on_generation=taken,
        saguaro_c=saguaro_c,
        transports=rec.factory if rec is not None else None,
    )
    rows = [mode_row(m, rtt_ms, temperature, r, gens[m]) for m, r in runs.items()]
    if rec is not None:
        tallies = await replay_idle(rec, [m for m in modes if m != "ar"])
        for row in rows:
            t = tallies.get(row["mode"])
            if t is not None:
                row["V_idle_replay_ms"] = median(t.verify_ms, 4)
                row["idle_replay_diverged"] = t.diverged + rec.lost.get(row["mode"], 0)
    return rows, entries


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rtt-ms", default="0,25,50,100", help="comma-separated round-trip times to emulate")
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (the code prompt, raw)")
    ap.add_argument(
        "--prompts", type=int, default=4, help="Spec-Bench dev prompts (round-robin over categories)"
    )
    add_common_args(
        ap,
        json=True,
        json_help="rewritten after every RTT x temperature block (complete: false until the end); "
        "besides the table's figures each row has V_ms (median verify ms a round as the client saw "
        "it), V_idle_ms (the same rounds' trees at the verifier's cost curve measured with the edge "
        "idle), T_b_ms (median synchronous draft ms after a miss), p (hit rate), stall_ms_per_round (a "
        "hit's wait for its next verdict beyond one verify, per round), prefill_share_ms_per_token "
        "(the prompt's round 0 over the tokens), decode_ms_per_token (ms_per_token minus it: after "
        "the prompt is in the cache), ttft_ms (median time to the first token) and gap_ms (median "
        "ms the verifier waited for the "
        "edge's next tree); bench.network_report.decomposition defines each; identical_to_ar (every "
        "generation's tokens equal mode ar's for the prompt at that temperature, ar run at any RTT of "
        "the run; null for mss / rrs and without ar); with --idle-replay also V_idle_replay_ms and "
        "idle_replay_diverged",
        tokens=64,
        prompt_file=True,
        no_progress=True,
    )
    ap.add_argument(
        "--draft", default=DEFAULT_DRAFT, help="draft alias or GGUF path (or an ONNX export folder)"
    )
    ap.add_argument(
        "--drafter",
        default="auto",
        choices=backend_choices(),
        help="draft backend (auto: llama.cpp or the ONNX int8 export, whichever is faster on this machine, "
        "measured once and cached; onnx: --draft may also be an `edge-client export-onnx` folder)",
    )
    add_model_args(ap, model=DEFAULT_TARGET)
    ap.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "fp32", "quantized"],
        help="the verifier's --weights: a GGUF target dequantized to fp32, or run from its quantized "
        "blocks (a faster target on CPUs, numerically a different one); auto (the verifier's default: "
        "quantized for a GGUF on a CPU) is resolved here, and the results name what ran",
    )
    ap.add_argument(
        "--tree",
        default=None,
        help="expansion config of the tree modes (the sequence draft is as deep); default: the draft's "
        "recommended tree (edge_client.defaults: measured per pair, docs/results.md)",
    )
    ap.add_argument("--temperatures", default="0,0.7", help="0 = greedy; others run sample-and-match")
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"modes to run, from {','.join(MODES + OPTIONAL)}"
    )
    add_link_args(ap)


def add_link_args(ap: argparse.ArgumentParser) -> None:
    """The link's flags (proxy, jitter, bandwidth), the verifier's queue, the outputs beside --json
    (--trace, --plot) and the run's variations (--no-couple, --saguaro-c, --idle-replay, --merge)."""
    ap.add_argument(
        "--proxy",
        action="store_true",
        help="put a TCP delay proxy process on the path instead of the in-process link shaper",
    )
    ap.add_argument(
        "--jitter-ms", type=float, default=0.0, help="jitter of the emulated link (never reorders)"
    )
    ap.add_argument("--bandwidth-mbps", type=float, default=0.0, help="bandwidth cap of the link (0: none)")
    ap.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="the verifier's max_pending (conditional trees a session may queue; default: the "
        "verifier's own, cloud_verifier.server_config)",
    )
    ap.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="write every generation's round trace to this JSON file ({'config', 'generations': [{mode, "
        "rtt_ms, temperature, prompt_index, trace, stats}]}: each send, verdict and draft with its "
        "time), rewritten after every RTT x temperature block; the input of bench.simulation.simulate",
    )
    ap.add_argument("--plot", default=None, help="draw ms/token against RTT to this PNG")
    ap.add_argument(
        "--no-couple",
        action="store_true",
        help="sample-and-match rows draft without the verifier's keyed uniforms (the draft's most likely "
        "tokens lead each node instead of the token the target is likely to sample)",
    )
    ap.add_argument(
        "--saguaro-c",
        type=float,
        default=1.0,
        metavar="C",
        help="Saguaro sampling in every pre-speculating mode (mss / rrs only: the q rows the edge draws "
        "from and ships scale the candidates it caches by C, 0 < C <= 1; 1: off); one C a run, kept in "
        "the JSON config: a C sweep is a run per C",
    )
    ap.add_argument(
        "--idle-replay",
        action="store_true",
        help="after each RTT x temperature block, replay every tree mode's generations once (each frame "
        "the edge sent, as soon as the verdicts it waited on are in) with nothing drafting: the rows "
        "gain V_idle_replay_ms (the median verify ms a round of the same rounds, measured with the edge "
        "idle, beside V_ms with it drafting and V_idle_ms from the start-up cost curve) and "
        "idle_replay_diverged (generations whose replayed verdicts differed from the run's: 0 when the "
        "replay is faithful); each block takes about as long again as its tree modes' verify time",
    )
    ap.add_argument(
        "--merge",
        default=None,
        metavar="A.json,B.json",
        help="run nothing: merge the rows of earlier --json files (a later file's row replaces an "
        "earlier one for the same RTT, mode and temperature), then print the table and goals and "
        "write --json / --plot; the files must share draft, model, prompts, tokens and tree",
    )


def parse_lists(a: argparse.Namespace) -> tuple[list[float], list[float], list[str]]:
    """--rtt-ms, --temperatures and --modes as lists, checked with --saguaro-c (else a UsageError)."""
    try:
        rtts = [float(x) for x in a.rtt_ms.split(",") if x]
        temps = [float(x) for x in a.temperatures.split(",") if x]
    except ValueError as exc:
        raise UsageError(f"--rtt-ms and --temperatures take comma-separated numbers ({exc})") from exc
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES + OPTIONAL]
    if unknown or not modes:
        raise UsageError(
            f"--modes: unknown {unknown or 'none given'}; choose from {','.join(MODES + OPTIONAL)}"
        )
    if not 0 < a.saguaro_c <= 1:
        raise UsageError(f"--saguaro-c must be in (0, 1], got {a.saguaro_c}")
    return rtts, temps, modes


def verifier_args(
    max_pending: int | None, modes: Sequence[str], weights: str = "fp32"
) -> tuple[list[str], str | None]:
    """The verifier's extra flags and the API key its clients send: --max-pending when given,
    --weights, and a key file with one trusted key when an rrs mode runs (the stochastic modes
    need one)."""
    args = [] if max_pending is None else ["--max-pending", str(max_pending)]
    args += ["--weights", weights]
    api_key = None
    if any(m in STOCHASTIC_MODES for m in modes):
        key_file, api_key = trusted_key_file()
        args += ["--api-key-file", str(key_file)]
    return args, api_key


def run_link(
    verifier: Verifier,
    split: CoreSplit,
    drafter: Drafter,
    prompts: Sequence[BenchPrompt],
    tree: ExpansionConfig,
    rtt: float,
    temp: float,
    modes: Sequence[str],
    api_key: str | None,
    *,
    tokens: int,
    proxy: bool,
    jitter_ms: float,
    mbps: float,
    couple: bool,
    progress: bool,
    saguaro_c: float,
    idle_replay: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One block (run_block) over a link emulated at `rtt` (with `jitter_ms` and a cap of `mbps`):
    through a delay proxy process on the edge's cores with `proxy`, else the in-process shaper."""
    with contextlib.ExitStack() as stack:
        url, link = verifier.url, None
        if proxy:
            url = stack.enter_context(Proxy(verifier.port, rtt, jitter_ms, mbps, split.edge)).url
        else:
            link = LinkShape.rtt(rtt, jitter_ms, mbps)
        return asyncio.run(
            run_block(
                url,
                drafter,
                prompts,
                tokens,
                rtt,
                temp,
                tree,
                verifier.forwards,
                modes,
                link=link,
                api_key=api_key,
                couple=couple,
                progress=progress,
                saguaro_c=saguaro_c,
                idle_replay=idle_replay,
            )
        )


def run(a: argparse.Namespace) -> Result:
    if a.merge:
        try:
            merged, config = merge([p for p in a.merge.split(",") if p])
        except ValueError as exc:
            raise UsageError(f"--merge: {exc}") from exc
        return report(merged, config)
    rtts, temps, modes = parse_lists(a)
    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    print(f"link: {'TCP delay proxy process' if a.proxy else 'in-process shaper'}", flush=True)
    prompts = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    a.tree = a.tree or recommended_tree(a.draft)
    tree = ExpansionConfig.parse(a.tree)
    rows: list[dict[str, Any]] = []
    generations: list[dict[str, Any]] = []
    if a.weights == "auto":
        a.weights = resolve_weights(a.model, progress=not a.no_progress)
    args, api_key = verifier_args(a.max_pending, modes, a.weights)
    verifier = Verifier(a.model, cores=split.verifier, threads=len(split.verifier), args=args)
    with verifier:
        split.pin_edge()
        drafter = create_drafter(a.drafter, a.draft, n_threads=1)
        a.drafter = drafter.name  # auto resolved: the report's config names the backend that drafted
        try:
            for rtt in rtts:
                for temp in temps:
                    # mss / rrs sample: none of them at temperature 0
                    block_modes = [m for m in modes if temp > 0 or m not in STOCHASTIC_MODES]
                    if not block_modes:
                        continue
                    block, entries = run_link(
                        verifier,
                        split,
                        drafter,
                        prompts,
                        tree,
                        rtt,
                        temp,
                        block_modes,
                        api_key,
                        tokens=a.tokens,
                        proxy=a.proxy,
                        jitter_ms=a.jitter_ms,
                        mbps=a.bandwidth_mbps,
                        couple=not a.no_couple,
                        progress=not a.no_progress,
                        saguaro_c=a.saguaro_c,
                        idle_replay=a.idle_replay,
                    )
                    rows += block
                    generations += entries
                    same = identical_to_ar(generations, STOCHASTIC_MODES)
                    for r in rows:
                        r["identical_to_ar"] = same.get((r["mode"], r["rtt_ms"], r["temperature"]))
                    print(f"rtt {rtt:g} ms, T={temp:g}: done", flush=True)
                    # a crash later keeps what is measured
                    write_result(a.json, a, rows, False)
                    write_trace(a.trace, vars(a), generations)
        finally:
            drafter.close()
    return report(rows, vars(a))


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
