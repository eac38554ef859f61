"""The quantized-block projections against the float32 path, on a real GGUF's matrices.

For each distinct (type, shape) of one decoder layer's projections and of the LM head in the GGUF
(default: the 1.5B target's Q4_K_M file): ms per call for 1 to 16 rows, on 1 and 2 threads, of

- quant: `treespec_kernels.quant_matmul` straight from the file's blocks (int8 activations);
- fp32:  the model's float32 path on the dequantized matrix (`LlamaModel`'s Gemm: oneDNN with
  the weight packed once where torch has it, else F.linear), i.e. what the verifier runs today;

and the bytes each keeps (the blocks vs 4 bytes a weight). Medians of --repeats calls after one
warm-up. What to read from the table: a 16-row call <= 3x a one-row call, and one row
well below the float32 path (the whole forward is `python -m bench target_step`'s).

    python -m bench quant_matmul
    python -m bench quant_matmul --rows 1,4,16 --threads 2 --json out.json
    python -m bench quant_matmul --roofline --json roofline.json --plot roofline.png
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other benches: no spinning waiters

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from bench.harness import add_common_args, table
from bench.kernels import roofline
from bench.kernels.roofline import matrices
from bench.lib import runner
from shared.model.llama import Gemm, choose_gemm
from treespec_kernels import quant_matmul as qm


def _ints(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a GGUF: model alias or path")
    ap.add_argument("--rows", type=_ints, default=[1, 2, 4, 8, 16], help="row counts, comma-separated")
    ap.add_argument("--threads", type=_ints, default=[1, 2], help="torch thread counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per cell (the median is shown)")
    ap.add_argument("--no-head", action="store_true", help="leave the LM head out (the largest matrix)")
    ap.add_argument(
        "--roofline",
        action="store_true",
        help="instead: the roofline report (python -m bench roofline, which takes the other flags: "
        "see its --help): the machine's read bandwidth and integer-step GOPS, each projection's cold "
        "GB/s and GOPS by rows, the whole forward's share of each roof, a plot",
    )
    ap.add_argument(
        "--compare-avx2",
        action="store_true",
        help="also time the same kernel built for x86-64-v3 (AVX2, no AVX-512), column avx2_ms: what "
        "this machine's AVX-512 paths gain, measured side by side",
    )
    add_common_args(ap, json=True, no_progress=True)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(args: argparse.Namespace) -> list[dict[str, object]]:
    """One row per matrix, thread count and row count: the kernels' median ms and the bytes each keeps."""
    from shared.model_store import resolve

    if qm.load() is None:
        raise SystemExit(f"the quant_matmul kernel is not available: {qm.error()}")
    mats = matrices(str(resolve(args.model)), not args.no_head)
    gemm = Gemm(choose_gemm("auto", torch.device("cpu"), torch.float32))
    rows_out: list[dict[str, object]] = []
    total = len(mats) * len(args.threads) * len(args.rows)
    before = torch.get_num_threads()
    # the same source built for x86-64-v3 (AVX2 only), timed beside this machine's build
    avx2_mod = qm.build_for("x86-64-v3") if args.compare_avx2 else None
    with tqdm(total=total, desc="timing", unit="cell", disable=args.no_progress) as bar:
        for name, q, blocks, dense in mats:
            packed = gemm.pack(torch.from_numpy(dense))
            out_f, in_f = dense.shape
            for threads in args.threads:
                torch.set_num_threads(threads)
                for rows in args.rows:
                    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows))
                    quant = _median_ms(lambda: qm.quant_matmul(x, blocks, q), args.repeats)  # noqa: B023
                    fp32 = _median_ms(lambda: gemm.linear(x, packed), args.repeats)  # noqa: B023
                    avx2 = (
                        None
                        if avx2_mod is None
                        else _median_ms(lambda: avx2_mod.quant_matmul(x, blocks, q.ggml_id), args.repeats)  # noqa: B023
                    )
                    rows_out.append(
                        {
                            "matrix": name,
                            "type": q.name,
                            "out": out_f,
                            "in": in_f,
                            "threads": threads,
                            "rows": rows,
                            "quant_ms": round(quant, 3),
                            "fp32_ms": round(fp32, 3),
                            "quant_over_fp32": round(quant / fp32, 3),
                            "avx2_ms": None if avx2 is None else round(avx2, 3),
                            "simd": qm.simd(),
                            "quant_bytes": blocks.numel(),
                            "fp32_bytes": dense.size * 4,
                        }
                    )
                    bar.update()
    torch.set_num_threads(before)
    return rows_out


def render_table(rows: Sequence[dict[str, object]], compare_avx2: bool, most: int) -> str:
    """The SIMD paths, the table, and per matrix and thread count the most rows' ms over one row's."""
    keys = ["matrix", "type", "out", "in", "threads", "rows", "quant_ms", "fp32_ms", "quant_over_fp32"]
    keys += ["avx2_ms"] if compare_avx2 else []
    lines = [f"kernel SIMD paths: {qm.simd()}", table([[r[k] for k in keys] for r in rows], keys)]
    one = {(r["matrix"], r["threads"]): r["quant_ms"] for r in rows if r["rows"] == 1}
    for r in rows:
        base = one.get((r["matrix"], r["threads"]))
        if r["rows"] == most and most > 1 and isinstance(base, float):
            ratio = float(str(r["quant_ms"])) / base
            lines.append(f"{r['matrix']}, {r['threads']} threads: {r['rows']} rows / 1 row = {ratio:.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> runner.Result:
    if args.repeats < 1:
        raise runner.UsageError("--repeats must be at least 1")
    rows = measure(args)
    return runner.Result(rows, render_table(rows, args.compare_avx2, max(args.rows)))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--roofline" in argv:  # the roofline report: bench.kernels.roofline with the other flags
        return roofline.main([a for a in argv if a != "--roofline"])
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
