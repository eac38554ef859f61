"""The quantized target's projections and whole forward against this machine's two roofs, on the
same cores.

`python -m bench roofline` (also `python -m bench quant_matmul --roofline`) measures:

- The bandwidth roof: a read of a buffer many times the last-level cache (`stream_read`: every
  64-byte line once, split across the threads), in GB/s.
- The compute roof: the K types' integer step (`int_peak`: one dpbusd per 64 multiply-adds with AVX-512 VNNI,
  maddubs, madd and add with AVX2) on values in registers, in GOPS (a multiply-add is two ops).
- Each distinct (type, shape) of layer 0's projections and the LM head, at 1, 2, 3, 4, 8 and 16
  rows: ms, GB/s of weight bytes and GOPS, read cold (the matrix is cycled through copies larger
  than the last-level cache, as a forward reads it once from memory), and their shares of the roofs.
  The K types run as the model runs them: repacked at load where the CPU has AVX-512 VNNI (GB/s of
  the packed bytes; column `packed`), from their blocks with TREESPEC_PACKED_ROWS=0.
- The whole forward (`forward_packed` after a 128-token prefix; attention, norms and the head
  included): its share of the bandwidth roof at one row (the projections' and head's bytes over
  its time) and of the compute roof at 16 rows (their multiply-adds over its time).

--plot draws the roofline: GOPS against ops per weight byte, the roofs as lines, the projections
and forwards as points.

    python -m bench roofline --json out.json --plot out.png
    python -m bench roofline --threads 1 --rows 1,16 --no-forward
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other benches: no spinning waiters

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.lib import runner
from bench.lib.args import add_common_args, add_model_args, positive_ints
from bench.lib.results import save_figure, table
from shared.model_store import DEFAULT_TARGET
from treespec_kernels import quant_matmul as qm

BUFFER_MB = 1024  # the bandwidth probe's buffer: far past any last-level cache of a server core of today
COLD_MB = 256  # at least this many bytes of copies per projection timing, so that reads come from memory
PREFIX = 128


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(ap, model=DEFAULT_TARGET, model_help="a GGUF target: model alias or path")
    ap.add_argument(
        "--threads", type=positive_ints, default=[1, 2], help="torch thread counts, comma-separated"
    )
    ap.add_argument(
        "--rows", type=positive_ints, default=[1, 2, 3, 4, 8, 16], help="activation rows, comma-separated"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per cell (the median is shown)")
    ap.add_argument(
        "--no-forward", action="store_true", help="leave the whole forward out (projections only)"
    )
    ap.add_argument(
        "--grid",
        type=positive_ints,
        default=None,
        metavar="LO,HI",
        help="run the K types' row counts LO..HI on the grid of weight rows x activation rows "
        "(AVX-512 VNNI; the kernel's default: 7,8) for this run",
    )
    ap.add_argument(
        "--plot", type=Path, default=None, metavar="PATH", help="write the roofline plot (PNG) here"
    )
    add_common_args(ap, json=True, json_help="rows: one per (part, threads, rows); roofs", no_progress=True)


def matrices(path: str, head: bool) -> list[tuple[str, qm.QuantType, torch.Tensor, np.ndarray]]:
    """(name, type, blocks [out, bytes], dequantized float32 [out, in]) of layer 0's projections and
    the head, one per distinct (type, shape)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    out = []
    for t in reader.tensors:
        if not (t.name.startswith("blk.0.") or (head and t.name == "output.weight")):
            continue
        if not t.name.endswith(".weight") or t.tensor_type.name not in qm.QTYPES:
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        key = (t.tensor_type.name, shape)
        if key in seen:
            continue
        seen.add(key)
        blocks = torch.from_numpy(np.array(t.data, copy=True)).reshape(shape[0], -1)
        dense = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        out.append((t.name, qm.qtype(t.tensor_type.name), blocks, dense))
    return out


def bandwidth_gbs(repeats: int) -> float:
    """The read bandwidth of the current torch threads, GB/s (median of `repeats` reads)."""
    mod = qm._require()
    buf = torch.ones(BUFFER_MB << 20, dtype=torch.uint8)
    mod.stream_read(buf)  # touch every page first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mod.stream_read(buf)
        times.append(time.perf_counter() - t0)
    return buf.numel() / statistics.median(times) / 1e9


def peak_gops(repeats: int, iters: int = 1_000_000) -> float:
    """The integer step's throughput on the current torch threads, GOPS (the best of `repeats`)."""
    mod = qm._require()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        macs = mod.int_peak(iters)
        best = max(best, 2 * macs / (time.perf_counter() - t0) / 1e9)
    return best


def projection_rows(
    path: str, threads: int, rows: Sequence[int], repeats: int, roofs: dict[str, float], bar: Any
) -> list[dict[str, Any]]:
    """One row per (distinct projection, rows): cold ms, GB/s, GOPS and the shares of the roofs."""
    out = []
    for name, q, blocks, dense in matrices(path, True):
        out_f, in_f = dense.shape
        copies = [blocks] + [blocks.clone() for _ in range(-(-(COLD_MB << 20) // blocks.numel()) - 1)]
        # as the model runs them: repacked at load where the kernel can (TREESPEC_PACKED_ROWS=0: not)
        packs = [qm.pack(c, q, in_f) if qm.packing() else None for c in copies]
        read = blocks.numel() if packs[0] is None else packs[0].numel()
        for n in rows:
            x = torch.randn(n, in_f, generator=torch.Generator().manual_seed(n))
            times = []
            for rep in range(repeats + 1):
                t0 = time.perf_counter()
                for c, p in zip(copies, packs, strict=True):
                    qm.quant_matmul(x, c, q, p)
                if rep:
                    times.append((time.perf_counter() - t0) / len(copies))
            s = statistics.median(times)
            head = {"part": name, "type": q.name, "out": out_f, "in": in_f, "threads": threads, "rows": n}
            head["packed"] = packs[0] is not None
            out.append(head | _measures(s, read, n * out_f * in_f, roofs))
            bar.update()
    return out


def _measures(seconds: float, nbytes: int, macs: int, roofs: dict[str, float]) -> dict[str, Any]:
    """A timed part's ms, weight GB/s and GOPS, their shares of the roofs, and its ops per byte."""
    gbs, gops = nbytes / seconds / 1e9, 2 * macs / seconds / 1e9
    return {
        "ms": round(seconds * 1e3, 4),
        "gb_s": round(gbs, 2),
        "gops": round(gops, 1),
        "bandwidth_share": round(gbs / roofs["bandwidth_gb_s"], 3),
        "compute_share": round(gops / roofs["peak_gops"], 3),
        "ops_per_byte": round(2 * macs / nbytes, 3),
    }


def forward_work(path: str) -> tuple[int, int]:
    """(weight bytes a forward reads, multiply-adds per row): every layer's projections and the head
    (the token table's one row per token is left out)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    nbytes = macs = 0
    for t in reader.tensors:
        if (
            t.name.startswith("blk.") and t.name.endswith(".weight") and t.tensor_type.name in qm.QTYPES
        ) or t.name == head:
            shape = [int(v) for v in t.shape.tolist()]
            if len(shape) == 2:
                nbytes += int(t.n_bytes)
                macs += shape[0] * shape[1]
    return nbytes, macs


def forward_rows(
    model: str, path: str, threads: int, rows: Sequence[int], repeats: int, roofs: dict[str, float], bar: Any
) -> list[dict[str, Any]]:
    """One row per forward size: ms, the weights' GB/s and GOPS, and the shares of the roofs."""
    from bench.kernels.target_step import measure_forward
    from shared.model import load_target

    target = load_target(model, weights="quantized")
    forward, _ = measure_forward(target, [PREFIX], rows, repeats, bar)
    nbytes, macs = forward_work(path)
    out = []
    for n in rows:
        s = forward[str(PREFIX)][str(n)] / 1e3
        head = {"part": "forward", "type": "all", "out": None, "in": None, "threads": threads, "rows": n}
        out.append(head | _measures(s, nbytes, n * macs, roofs))
    return out


def plot(path: Path, rows: list[dict[str, Any]], roofs: dict[int, dict[str, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    xs = [0.5 * 1.25**i for i in range(60)]
    for threads, roof in sorted(roofs.items()):
        ys = [min(roof["peak_gops"], roof["bandwidth_gb_s"] * x) for x in xs]
        ax.plot(xs, ys, "-", lw=2 if threads == 1 else 1, color="black", alpha=1.0 if threads == 1 else 0.5)
        ax.annotate(
            f"{threads} thread(s): {roof['bandwidth_gb_s']:.0f} GB/s, {roof['peak_gops']:.0f} GOPS",
            (xs[-1], roof["peak_gops"]),
            ha="right",
            va="bottom",
            fontsize=8,
        )
    marker = {1: "o", 2: "s"}
    parts = sorted({r["part"] for r in rows if r["part"] != "forward"})
    cmap = plt.get_cmap("tab10")
    colors = {p: cmap(i % 10) for i, p in enumerate(parts)}
    for r in rows:
        forward = r["part"] == "forward"
        ax.plot(
            r["ops_per_byte"],
            r["gops"],
            "*" if forward else marker.get(r["threads"], "^"),
            color="red" if forward else colors[r["part"]],
            ms=11 if forward else 5,
            alpha=0.8,
        )
        if forward or r["part"] == parts[0]:
            ax.annotate(
                str(r["rows"]),
                (r["ops_per_byte"], r["gops"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    for p in parts:
        ax.plot([], [], "o", color=colors[p], label=p)
    ax.plot([], [], "*", color="red", ms=11, label="whole forward (number: rows)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ops per weight byte (2 x rows x out x in / bytes of blocks)")
    ax.set_ylabel("GOPS (int8 multiply-adds x 2)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path, dpi=110)


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[int, dict[str, float]]]:
    """The rows (projections, then the forward, per thread count) and the roofs per thread count."""
    from shared.model_store import resolve

    if qm.load() is None:
        raise SystemExit(f"the quant_matmul kernel is not available: {qm.error()}")
    path = str(resolve(args.model))
    rows: list[dict[str, Any]] = []
    roofs: dict[int, dict[str, float]] = {}
    before = torch.get_num_threads()
    parts = 7
    total = len(args.threads) * (
        parts * len(args.rows) + (0 if args.no_forward else args.repeats * len(args.rows))
    )
    with tqdm(total=total, desc="roofline", unit="cell", disable=args.no_progress) as bar:
        for threads in args.threads:
            torch.set_num_threads(threads)
            roof = {
                "bandwidth_gb_s": round(bandwidth_gbs(args.repeats), 2),
                "peak_gops": round(peak_gops(args.repeats), 1),
            }
            roofs[threads] = roof
            rows += projection_rows(path, threads, args.rows, args.repeats, roof, bar)
            if not args.no_forward:
                rows += forward_rows(args.model, path, threads, args.rows, args.repeats, roof, bar)
    torch.set_num_threads(before)
    return rows, roofs


def render_table(rows: Sequence[dict[str, Any]], roofs: dict[int, dict[str, float]]) -> str:
    """The SIMD paths and roofs, the table, then the forward's shares of the roofs."""
    lines = [f"kernel SIMD paths: {qm.simd()}"]
    for threads, roof in roofs.items():
        lines.append(
            f"{threads} thread(s): read bandwidth {roof['bandwidth_gb_s']} GB/s, "
            f"integer step {roof['peak_gops']} GOPS"
        )
    keys = [
        "part",
        "type",
        "out",
        "in",
        "threads",
        "rows",
        "ms",
        "gb_s",
        "gops",
        "bandwidth_share",
        "compute_share",
    ]
    lines.append(table([[r[k] for k in keys] for r in rows], keys))
    for r in rows:
        if r["part"] == "forward" and r["rows"] == 1:
            lines.append(
                f"forward, {r['threads']} thread(s), 1 row: {r['bandwidth_share']:.0%} of the bandwidth roof"
            )
        if r["part"] == "forward" and r["rows"] == 16:
            lines.append(
                f"forward, {r['threads']} thread(s), 16 rows: {r['compute_share']:.0%} of the compute roof"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> runner.Result:
    if args.repeats < 1:
        raise runner.UsageError("--repeats must be at least 1")
    if args.grid is not None:
        if len(args.grid) != 2 or args.grid[0] > args.grid[1]:
            raise runner.UsageError("--grid takes two row counts LO,HI with LO <= HI, e.g. 3,16")
        if "avx512-vnni" not in qm.simd():
            raise runner.UsageError(f"--grid needs AVX-512 VNNI; this CPU's paths: {qm.simd()}")
        qm._require().set_grid_rows(*args.grid)
    rows, roofs = measure(args)
    return runner.Result(
        rows,
        render_table(rows, roofs),
        extra={"roofs": {str(k): v for k, v in roofs.items()}, "simd": qm.simd(), "grid": args.grid},
        plot=lambda path: plot(
            path,
            [r for r in rows if r["threads"] == min(roofs)] + [r for r in rows if r["part"] == "forward"],
            roofs,
            f"{args.model}, quantized blocks, {qm.simd()}",
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
