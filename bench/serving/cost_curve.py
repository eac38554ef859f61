"""The live verify cost curve (cloud_verifier/live_cost.py) converging from a poisoned start-up curve
to the forwards the target actually runs.

The verifier measures its cost curve once at start-up (cloud_verifier/cost.py) and refreshes it
from every forward it runs (cloud_verifier/live_cost.py). This bench measures the start-up curve
as the server does, poisons it (--poison: every value times a factor, as a measurement taken while
the machine was busy; --busy: measured while busy-loop processes share the cores), then runs
--forwards forwards of the sizes a verifier runs (tree rounds of 4, 8 and 16 nodes, stream steps
of one row, two sessions' trees packed in one forward, a prefill chunk now and then), each fed to
`LiveCost.observe`, and records after each forward what the curve advertises at N = 0, 1, 4, 8.

Figures, per N: the advertised ms at the start (poisoned) and the end, the reference (the median
measured forward of that size over the run's second half), their errors, and the forward after
which the advertised ms stays within --tolerance of the reference. --json writes them (rows: one
per N; `trace`: every forward), --plot the advertised ms against the measured forwards.

The forwards are timed alone (model.forward_packed, synchronised on a GPU); the engine also counts
its verification and commit, a few percent more.

    python -m bench cost_curve --model smollm2-135m --json out.json --plot out.png
"""

from __future__ import annotations

import os

# as bench.kernels.target_step: OpenMP waiters sleep, so a shared core does not stall whole slices
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import multiprocessing
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.harness import add_common_args, save_figure
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result
from cloud_verifier.cost import DEFAULT_NODES, measure_verify_cost
from cloud_verifier.live_cost import LiveCost
from shared.model import SeqInput, Target, load_target, prefill, prefill_chunk, tree_round
from shared.model.kv_cache import PagedKVCache
from shared.model_store import DEFAULT_TARGET
from shared.tree import TokenTree

SEED = 0  # the mix of forward sizes and the tokens: the same every run
SHOWN = (0, 1, 4, 8)  # the N whose advertised ms is traced
AFTER = (5, 10, 20)  # the advertised ms's error is reported after this many forwards
# the forwards a verifier runs: (weight, what): N nodes of one session, "2x8" two sessions' 8-node
# trees in one forward (18 rows: N = 17)
MIX: tuple[tuple[float, str], ...] = (
    (0.35, "8"),
    (0.2, "0"),
    (0.15, "4"),
    (0.1, "1"),
    (0.1, "2x8"),
    (0.1, "16"),
)


def bench_tree(nodes: int, base: int, vocab: int, seed: int) -> TokenTree:
    """A drafted-looking tree (each node's parent among the 4 before it) of `nodes` nodes."""
    rng = np.random.default_rng(seed)
    parents = [-1] + [int(rng.integers(max(-1, i - 4), i)) for i in range(1, nodes)]
    return TokenTree.build(rng.integers(3, vocab, nodes), parents[:nodes], base=base)


class Forwards:
    """Sessions with `prefix` committed tokens each, and one forward of any kind over them (its KV
    rows discarded afterwards, so every forward sees the same context)."""

    def __init__(self, target: Target, prefix: int, chunk: int, seed: int) -> None:
        self.target, self.prefix, self.chunk = target, prefix, chunk
        self.vocab = target.config.vocab_size
        self.rng = np.random.default_rng(seed)
        blocks = 3 * (-(-(prefix + max(chunk, 64) + 1) // 16)) + 8
        self.kv: PagedKVCache = target.new_kv_cache(blocks, 16)
        for seq in (0, 1, 2):
            self.kv.add(seq)
            prefill(target.model, self.kv, seq, self.rng.integers(3, self.vocab, prefix - 1).tolist())

    def inputs(self, kind: str, i: int) -> list[SeqInput]:
        tok = int(self.rng.integers(3, self.vocab))
        if kind == "prefill":  # a prompt chunk of `chunk` rows
            return [prefill_chunk(2, self.rng.integers(3, self.vocab, self.chunk).tolist(), self.prefix - 1)]
        if kind == "0":  # a stream step / `ar` token: row 0 alone
            return [prefill_chunk(0, [tok], self.prefix - 1)]
        if kind == "2x8":
            return [tree_round(s, bench_tree(8, self.prefix, self.vocab, i * 2 + s), [tok]) for s in (0, 1)]
        return [tree_round(0, bench_tree(int(kind), self.prefix, self.vocab, i), [tok])]

    def run(self, kind: str, i: int) -> tuple[int, float]:
        """One forward: (rows, ms)."""
        inputs = self.inputs(kind, i)
        dev = self.target.device
        inputs = [
            SeqInput(
                x.seq_id,
                x.tokens.to(dev),
                x.positions.to(dev),
                None if x.tree_mask is None else x.tree_mask.to(dev),
                x.logit_rows.to(dev),
            )
            for x in inputs
        ]
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.target.model.forward_packed(inputs, self.kv)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ms = (time.perf_counter() - t0) * 1e3
        for x in inputs:
            self.kv.discard(x.seq_id)
        return sum(len(x.tokens) for x in inputs), ms


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def startup_curve(target: Target, busy: int) -> dict[int, float]:
    """The server's start-up measurement (cost.measure_verify_cost), with `busy` busy-loop
    processes running meanwhile."""
    kv = target.new_kv_cache(16, 16)
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for p in procs:
        p.start()
    try:
        return measure_verify_cost(target, kv, DEFAULT_NODES, prefix=64, repeats=3)
    finally:
        stop.set()
        for p in procs:
            p.join()


def schedule(forwards: int, prefill_every: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    kinds = [k for _, k in MIX]
    weights = [w for w, _ in MIX]
    out = rng.choices(kinds, weights, k=forwards)
    if prefill_every > 0:
        for i in range(prefill_every - 1, forwards, prefill_every):
            out[i] = "prefill"
    return out


def converged_at(values: Sequence[float], ref: float, tolerance: float) -> int | None:
    """The first forward (1-based) after which every value is within `tolerance` of `ref`; 0: from
    the start; None: never."""
    last_bad = -1
    for i, v in enumerate(values):
        if abs(v / ref - 1) > tolerance:
            last_bad = i
    return None if last_bad == len(values) - 1 else last_bad + 1


def summarize(trace: list[dict[str, Any]], start: dict[int, float], tolerance: float) -> list[dict[str, Any]]:
    """One row per shown N: start, end, reference, errors, the forward it converged at."""
    half = trace[len(trace) // 2 :]
    rows = []
    for n in SHOWN:
        measured = [t["ms"] for t in half if t["nodes"] == n]
        ref = statistics.median(measured) if measured else float("nan")
        advertised = [t["advertised"][str(n)] for t in trace]
        end = advertised[-1]
        rows.append(
            {
                "nodes": n,
                "start_ms": round(start[n], 2),
                "end_ms": round(end, 2),
                "reference_ms": round(ref, 2),
                "reference_forwards": len(measured),
                "start_error": round(start[n] / ref - 1, 3) if measured else None,
                "end_error": round(end / ref - 1, 3) if measured else None,
                "converged_at": converged_at(advertised, ref, tolerance) if measured else None,
                **{
                    f"error_after_{k}": round(advertised[k - 1] / ref - 1, 3)
                    if measured and k <= len(trace)
                    else None
                    for k in AFTER
                },
            }
        )
    return rows


def plot(path: Path, trace: list[dict[str, Any]], rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colors = dict(zip(SHOWN, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=True))
    xs = list(range(len(trace) + 1))
    for r in rows:
        n, c = r["nodes"], colors[r["nodes"]]
        ys = [r["start_ms"]] + [t["advertised"][str(n)] for t in trace]
        ax.plot(xs, ys, "--" if n == 0 else "-", color=c, label=f"advertised N={n}")
        pts = [(i + 1, t["ms"]) for i, t in enumerate(trace) if t["nodes"] == n]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o", color=c, ms=3, alpha=0.6)
        if r["reference_forwards"]:
            ax.axhline(r["reference_ms"], color=c, ls=":", lw=1)
    ax.set_xlabel("forward")
    ax.set_ylabel("ms (dots: measured forwards; dotted: median of the second half)")
    ax.set_title(title, fontsize=9)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=DEFAULT_TARGET, help="target alias or path (tiny, smollm2-135m: faster)"
    )
    p.add_argument(
        "--weights",
        default="quantized",
        choices=["fp32", "quantized"],
        help="the target's projections: 'quantized' (the service's default for a GGUF) or 'fp32'",
    )
    add_model_args(p, threads=0)
    p.add_argument(
        "--poison",
        type=float,
        default=2.0,
        help="multiply the measured start-up curve by this (1: as measured)",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        help="busy-loop processes running while the start-up curve is measured (a real busy machine)",
    )
    p.add_argument("--forwards", type=int, default=80, help="forwards run (and observed) after start-up")
    p.add_argument("--prefix", type=int, default=128, help="committed tokens each session attends to")
    p.add_argument(
        "--prefill-every",
        type=int,
        default=20,
        help="every this many forwards, a prefill chunk of --chunk rows (0: none)",
    )
    p.add_argument("--chunk", type=int, default=128, help="rows of a prefill chunk")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.2,
        help="converged: within this fraction of the reference (forwards of one size vary by ~10-20%% "
        "on a shared CPU)",
    )
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write the PNG plot here")
    add_common_args(
        p,
        json=True,
        json_help="rows: per N in 0,1,4,8 the start / end / reference ms and the forward it converged at; "
        "trace: every forward",
        no_progress=True,
    )


def render_table(rows: Sequence[dict[str, Any]], tolerance: float) -> str:
    """Per N: the advertised ms at the start and the end, the reference, the errors along the way and
    the forward it converged at, with the line that reads the errors."""
    errs = ("start_error", *(f"error_after_{k}" for k in AFTER), "end_error")
    lines = [f"{'N':>3} {'start ms':>9} {'end ms':>8} {'ref ms':>8} {'forwards':>8} "
             + " ".join(f"{e.replace('_error', '').replace('error_', ''):>9}" for e in errs)
             + f" {'converged at':>12}"]  # fmt: skip
    for r in rows:
        err = " ".join(f"{r[k]:>+9.1%}" if r[k] is not None else f"{'-':>9}" for k in errs)
        lines.append(f"{r['nodes']:>3} {r['start_ms']:>9.1f} {r['end_ms']:>8.1f} {r['reference_ms']:>8.1f} "
                     f"{r['reference_forwards']:>8} {err} {r['converged_at']!s:>12}")  # fmt: skip
    lines.append("(errors: advertised / reference - 1; converged at: the forward after which it stays "
                 f"within {tolerance:.0%})")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Result:
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    target = load_target(args.model, weights=args.weights, progress=not args.no_progress)
    target.model.prepare(True)  # as the service holds it
    measured = startup_curve(target, args.busy)
    poisoned = {n: round(ms * args.poison, 3) for n, ms in measured.items()}
    live = LiveCost(poisoned)
    start = {n: live.forward_ms(n) for n in SHOWN}
    fw = Forwards(target, args.prefix, args.chunk, SEED)
    for kind in ("8", "0"):  # warm-up (weight packing, allocator), not observed
        fw.run(kind, 0)
    trace: list[dict[str, Any]] = []
    for i, kind in enumerate(
        tqdm(schedule(args.forwards, args.prefill_every, SEED), disable=args.no_progress)
    ):
        n_rows, ms = fw.run(kind, i + 1)
        live.observe(n_rows, ms / 1e3, args.prefix)
        trace.append(
            {
                "kind": kind,
                "rows": n_rows,
                "nodes": n_rows - 1,
                "ms": round(ms, 3),
                "advertised": {str(n): live.forward_ms(n) for n in SHOWN},
            }
        )
    rows = summarize(trace, start, args.tolerance)
    wall = round(time.perf_counter() - t_start, 1)
    print(f"\n{target.model_id}, weights {args.weights}, {torch.get_num_threads()} threads; start-up curve "
          f"measured {measured} (busy {args.busy}), advertised x{args.poison:g}")  # fmt: skip
    final = live.curve()
    busy = f", measured beside {args.busy} busy loops" if args.busy else ""
    title = f"{target.model_id} ({args.weights}), start-up curve x{args.poison:g}{busy}"
    title += ": advertised vs measured"
    return Result(
        rows,
        f"{render_table(rows, args.tolerance)}\nfinal curve {final}; wall {wall} s",
        extra={
            "model": target.model_id,
            "threads": torch.get_num_threads(),
            "measured_startup_ms": measured,
            "advertised_startup_ms": poisoned,
            "final_curve_ms": final,
            "trace": trace,
            "wall_s": wall,
        },
        plot=lambda path: plot(path, trace, rows, title),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
