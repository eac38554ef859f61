"""Streamed weights: ms per forward vs rows and ms/token per mode at resident budgets of the
target's layers (serve --offload), against ar on the same streaming path.

`python -m bench offload`: a target larger than memory, SpecInfer's Figure 8 analog.

For each resident budget (a fraction of the layers' bytes: 1, 0.5, 0.25, 0.1) the verifier keeps
that much of the target in memory and streams the rest of its layers for every forward (`serve
--offload --resident-gb`; its KV pool comes out of the budget first, and at 1 the budget is raised
by the pool so that every layer stays). Two parts, each in its own process so peak RSS is the
budget's own (the forward part's weights get what the service's would):

  forward   ms per verify forward vs rows (1..64) after a 64-token prefix, with the stream's
            figures: bytes read per forward, the reader's time, the time a forward waited, the
            overlap (transfer hidden / transfer total) at 1 row, peak RSS
  modes     the edge against a verifier serving with that budget: ms/token, τ and target forwards
            per token for each mode (ar, tree, budget, ... as bench.end_to_end.network runs them, at
            --rtt-ms),
            bytes read per token (forwards per token x bytes per forward), the speed-up over ar at
            the same budget, and the verifier's peak RSS

Run alone (it measures a disk). On a GPU machine `--shape qwen2.5-coder-1.5b --device cuda
--offload host` runs the forward part on random weights of that shape (the GGUF cannot travel):
pinned host memory copied in on a side stream.

Table, JSON (rows carry part, resident_fraction, mode, ms_per_token, tau, peak_rss_gb, ...) and a
plot (ms/token by budget and mode; ms per forward vs rows by budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.harness import (
    CoreSplit,
    Verifier,
    add_common_args,
    positive_ints,
    save_figure,
    suite_from_args,
    table,
    write_result,
)

# the forward part (bench.kernels.offload_forward), re-exported here
from bench.kernels.offload_forward import GB as GB
from bench.kernels.offload_forward import forward_child as forward_child
from bench.kernels.offload_forward import layer_bytes_of as layer_bytes_of
from bench.kernels.offload_forward import run_forward_part as run_forward_part
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError

MODES = ("ar", "tree", "budget")


def fractions(text: str) -> list[float]:
    """An argparse type: comma list of resident fractions in [0, 1]."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not out or any(not 0 <= f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"expected fractions in [0, 1], got {text!r}")
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(ap, model="qwen2.5-coder-1.5b", model_help="target alias or GGUF path")
    ap.add_argument(
        "--weights",
        default="quantized",
        choices=["quantized", "fp32"],
        help="stream the GGUF's blocks (quantized) or the float-weight cache (fp32, ~6x the bytes)",
    )
    ap.add_argument("--offload", default="disk", choices=["disk", "host"], help="the verifier's --offload")
    ap.add_argument(
        "--resident",
        type=fractions,
        default=[1.0, 0.5, 0.25, 0.1],
        help="resident budgets, as fractions of the layers' bytes: the verifier's --resident-gb, its KV "
        "pool and the stream buffers coming out of it (at 1 raised by the pool: every layer stays)",
    )
    ap.add_argument(
        "--modes", default=",".join(MODES), help="edge modes, as bench.end_to_end.network names them"
    )
    ap.add_argument("--parts", default="forward,modes", help="forward, modes, or both")
    ap.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8, 16, 32, 64], help="verify rows")
    ap.add_argument("--repeats", type=int, default=2, help="timed forwards per row count (median)")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="round trip of the emulated link (modes)")
    ap.add_argument("--humaneval", type=int, default=2, help="HumanEval dev prompts (modes)")
    ap.add_argument("--prompts", type=int, default=0, help="Spec-Bench dev prompts (modes)")
    ap.add_argument("--offload-threads", type=int, default=2, help="the verifier's --offload-threads")
    ap.add_argument(
        "--shape",
        default=None,
        help="forward part only: random weights of this shape (bench.gpu_forward's SHAPES), not --model",
    )
    ap.add_argument("--device", default="cpu", help="forward part: cpu or cuda")
    ap.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write the plot here")
    ap.add_argument(
        "--merge",
        default=None,
        metavar="A.json,B.json",
        help="run nothing: put together earlier --json files of one model and weights (a budget's rows "
        "from the last file that has them, e.g. a budget measured again), print the tables, write "
        "--json and --plot",
    )
    # internal: one budget's forward run in a child process, "FRACTION:LAYER_BYTES:ENTRY"
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_common_args(
        ap,
        json=True,
        json_help="rows: part 'forward' (resident_fraction, held_gb, rows_ms, bytes_per_forward, "
        "overlap_1row, peak_rss_gb) and part 'modes' (resident_fraction, mode, ms_per_token, tau, "
        "bytes_read_per_token, speedup_vs_ar, peak_rss_gb)",
        tokens=32,
        prompt_file=True,
        no_progress=True,
    )


def budgets(args: argparse.Namespace, layer_bytes: int) -> dict[float, tuple[float, float]]:
    """Per resident fraction: the --resident-gb a verifier is given and the GB of it its KV pool
    takes (serve --offload makes the pool out of the budget first; the weights get the rest). Below
    1 the budget is the fraction of the layers' bytes; at 1 it is raised by the pool, so that every
    layer stays resident. Random weights (--shape) make no pool."""
    if args.shape:
        return {f: (f * layer_bytes / GB, 0.0) for f in args.resident}
    from cloud_verifier.kv_pool import kv_reserve_bytes
    from cloud_verifier.server_config import ServerConfig
    from shared.model.target import streamed_config

    c = streamed_config(args.model)
    base = ServerConfig(model=args.model, weights=args.weights, offload=args.offload, device=args.device)

    def pool(budget: float) -> float:
        return kv_reserve_bytes(replace(base, resident_gb=budget), c) / GB

    out = {}
    for f in args.resident:
        budget = f * layer_bytes / GB
        if f >= 1:  # the automatic pool grows with the budget (a share of it): rise to where it fits
            while pool(budget) > budget - layer_bytes / GB + 1e-9:
                budget = layer_bytes / GB + pool(budget)
        out[f] = (budget, pool(budget))
    return out


# ---------------------------------------------------------------------------------------------------
# The modes part (a verifier per budget, the edge as bench.end_to_end.network drives it)


def peak_rss_of(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / GB, 3)
    except OSError:
        return None
    return None


def run_modes_part(
    args: argparse.Namespace, budgets: dict[float, tuple[float, float]], bytes_per_forward: dict[float, int]
) -> list[dict[str, Any]]:
    from bench.end_to_end.network import run_link
    from edge_client.defaults import recommended_tree
    from edge_client.drafters.registry import create_drafter
    from shared.model_store import DEFAULT_DRAFT
    from shared.tree import ExpansionConfig

    modes = [m for m in args.modes.split(",") if m]
    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    prompts = suite_from_args(args.humaneval, args.prompts, args.prompt_file)
    tree = ExpansionConfig.parse(recommended_tree(DEFAULT_DRAFT))
    rows: list[dict[str, Any]] = []
    for f in args.resident:
        vargs = [
            "--weights",
            args.weights,
            "--offload",
            args.offload,
            "--resident-gb",
            f"{budgets[f][0]:.6f}",
            "--offload-threads",
            str(args.offload_threads),
        ]
        verifier = Verifier(args.model, cores=split.verifier, threads=len(split.verifier), args=vargs)
        with verifier:
            split.pin_edge()
            drafter = create_drafter("auto", DEFAULT_DRAFT, n_threads=1)
            try:
                block, _ = run_link(
                    verifier,
                    split,
                    drafter,
                    prompts,
                    tree,
                    args.rtt_ms,
                    0.0,
                    modes,
                    None,
                    tokens=args.tokens,
                    proxy=False,
                    jitter_ms=0.0,
                    mbps=0.0,
                    couple=True,
                    progress=not args.no_progress,
                    saguaro_c=1.0,
                )
            finally:
                drafter.close()
            assert verifier.proc is not None
            rss = peak_rss_of(verifier.proc.pid)
        rows += mode_rows(block, f, budgets[f], bytes_per_forward, rss)
        print(f"modes, resident {f:g}: done (verifier peak RSS {rss} GB)", flush=True)
    return rows


def mode_rows(
    block: Sequence[dict[str, Any]],
    fraction: float,
    budget: tuple[float, float],
    bytes_per_forward: dict[float, int],
    rss: float | None,
) -> list[dict[str, Any]]:
    """The modes part's rows from one budget's bench.end_to_end.network block: each mode's ms/token and τ, the
    bytes read per token (forwards per token x bytes per forward), the speed-up over ar."""
    ar = next((r["ms_per_token"] for r in block if r["mode"] == "ar"), None)
    out = []
    for r in block:
        fpt = r.get("target_forwards_per_token")
        bpf = bytes_per_forward.get(fraction)
        out.append(
            {
                "part": "modes",
                "resident_fraction": fraction,
                "mode": r["mode"],
                "ms_per_token": r["ms_per_token"],
                "tau": r["tau"],
                "target_forwards_per_token": fpt,
                "bytes_read_per_token": None if fpt is None or bpf is None else round(fpt * bpf),
                "speedup_vs_ar": None if not ar else round(ar / r["ms_per_token"], 3),
                "ratio_to_ar": None if not ar else round(r["ms_per_token"] / ar, 3),
                "peak_rss_gb": rss,
                "budget_gb": round(budget[0], 3),  # the verifier's --resident-gb
                "kv_pool_gb": round(budget[1], 3),  # the share of it its KV pool takes
            }
        )
    return out


# ---------------------------------------------------------------------------------------------------
# Report


def render_tables(rows: Sequence[dict[str, Any]], row_counts: Sequence[int]) -> str:
    """The forward part's table and the modes part's, each where the rows have that part."""
    out = []
    fwd = [r for r in rows if r["part"] == "forward"]
    if fwd:
        head = ["resident", "layers", *[f"N={n} ms" for n in row_counts], "MB/fwd", "overlap@1", "RSS GB"]
        body = [
            [
                f"{r['resident_fraction']:g}",
                f"{r['layers_resident']}/{r['layers']}",
                *[r["rows_ms"].get(str(n)) for n in row_counts],
                round(r["bytes_per_forward"] / 1e6, 1),
                r["overlap_1row"],
                r["peak_rss_gb"],
            ]
            for r in fwd
        ]
        out.append(table(body, head))
    md = [r for r in rows if r["part"] == "modes"]
    if md:
        head = ["resident", "mode", "ms/token", "x ar", "tau", "fwd/token", "MB read/token", "RSS GB"]
        body = [
            [
                f"{r['resident_fraction']:g}",
                r["mode"],
                r["ms_per_token"],
                r["ratio_to_ar"],
                r["tau"],
                r["target_forwards_per_token"],
                None if r["bytes_read_per_token"] is None else round(r["bytes_read_per_token"] / 1e6, 1),
                r["peak_rss_gb"],
            ]
            for r in md
        ]
        out.append(table(body, head))
    return "\n".join(out)


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in (r for r in rows if r["part"] == "forward"):
        ns = sorted(int(n) for n in r["rows_ms"])
        a.plot(
            ns, [r["rows_ms"][str(n)] for n in ns], marker="o", label=f"resident {r['resident_fraction']:g}"
        )
    a.set_xscale("log", base=2)
    a.set_xlabel("rows in the verify forward")
    a.set_ylabel("ms per forward")
    a.set_title("forward cost vs rows")
    a.legend(fontsize=8)
    md = [r for r in rows if r["part"] == "modes"]
    fr = sorted({r["resident_fraction"] for r in md}, reverse=True)
    modes = list(dict.fromkeys(r["mode"] for r in md))
    width = 0.8 / max(1, len(modes))
    for k, m in enumerate(modes):
        ys = [
            next((r["ms_per_token"] for r in md if r["mode"] == m and r["resident_fraction"] == f), 0)
            for f in fr
        ]
        b.bar([i + k * width for i in range(len(fr))], ys, width, label=m)
    b.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(fr))], [f"{f:g}" for f in fr])
    b.set_xlabel("resident fraction of the layers")
    b.set_ylabel("ms per token")
    b.set_title("ms/token by mode (lower is better)")
    if md:
        b.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110)


def run(args: argparse.Namespace) -> Result:
    if args.child:
        forward_child(args)  # prints its row as JSON for the parent
        return Result([])
    if args.merge:
        try:
            return merge(args, [Path(p) for p in args.merge.split(",") if p])
        except ValueError as exc:
            raise UsageError(f"--merge: {exc}") from None
    parts = {p for p in args.parts.split(",") if p}
    if not parts or parts - {"forward", "modes"}:
        raise UsageError(f"--parts: choose from forward, modes; got {args.parts!r}")
    if args.shape and "modes" in parts:
        raise UsageError("--shape (random weights) runs the forward part only: add --parts forward")
    if args.repeats < 1 or args.offload_threads < 1:
        raise UsageError("--repeats and --offload-threads must be >= 1")
    layer_bytes, entry = layer_bytes_of(args.model, args.weights, args.shape, args.device)
    plan = budgets(args, layer_bytes)
    print(f"layers (and a head of its own): {layer_bytes / GB:.3f} GB streamable; --resident-gb and the "
          f"KV pool's share by budget: {plan}", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    if "forward" in parts:
        rows += run_forward_part(args, plan, entry)
        write_result(args.json, args, rows, False, layer_bytes=layer_bytes)
    if "modes" in parts:
        bpf = {r["resident_fraction"]: r["bytes_per_forward"] for r in rows if r["part"] == "forward"}
        rows += run_modes_part(args, plan, bpf)
    return Result(
        rows,
        render_tables(rows, args.rows),
        extra={"layer_bytes": layer_bytes},
        plot=lambda path: plot(rows, path, plot_title(args, layer_bytes)),
    )


def plot_title(args: argparse.Namespace, layer_bytes: int) -> str:
    what = args.shape or args.model
    return f"{what} ({args.weights}), --offload {args.offload}, layers {layer_bytes / GB:.2f} GB"


def merge(args: argparse.Namespace, paths: Sequence[Path]) -> Result:
    """--merge: the rows of earlier runs by budget (the last file with a budget's rows of a part
    gives them), with the first file's settings; refuses files of another model, weights or offload."""
    docs = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    if len(docs) < 2:
        raise ValueError("give two or more files")
    keys = ("model", "weights", "offload", "shape")
    first = {k: docs[0]["config"].get(k) for k in keys}
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for path, doc in zip(paths, docs, strict=True):
        other = {k: doc["config"].get(k) for k in keys}
        if other != first:
            raise ValueError(f"{path} is of {other}, the first file of {first}")
        here: dict[tuple[str, float], list[dict[str, Any]]] = {}
        for r in doc["rows"]:
            here.setdefault((r["part"], r["resident_fraction"]), []).append(r)
        by.update(here)
    rows = [r for key in sorted(by, key=lambda k: (k[0], -k[1])) for r in by[key]]
    for k, v in first.items():
        setattr(args, k, v)
    cfg = {**docs[0]["config"], "merged_from": [str(p) for p in paths]}
    layer_bytes = docs[0]["layer_bytes"]
    return Result(
        rows,
        render_tables(rows, sorted({int(n) for r in rows if r["part"] == "forward" for n in r["rows_ms"]})),
        extra={"layer_bytes": layer_bytes},
        config=cfg,
        plot=lambda path: plot(rows, path, plot_title(args, layer_bytes)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
