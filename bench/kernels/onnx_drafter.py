"""Draft tokens/s on one thread (decode steps, tree levels of 8 rows): onnx fp32, onnx int8 and
llama.cpp Q4, per draft model; int8 (and Q4) vs fp32 top-1 agreement and total variation.

int8 is the default `export-onnx --int8` (8-bit blocks, MatMulNBits); `--backends ...,dynamic` adds
onnxruntime's quantize_dynamic export (`--int8-method dynamic`, from --dynamic-dir).

For each model: plain decode steps (one new committed token per `sync`, the drafter's cost per
accepted token) and tree levels of 8 rows (one `extend` of 8 children of the committed end, the
cost of one level of a wide tree), as draft tokens per second; then int8 vs fp32 agreement on the
positions the decode steps visited (fp32's greedy continuations of a few prompts): top-1 agreement
and mean total variation of the next-token distributions. llama.cpp Q4 runs the same GGUF that
the ONNX graph was dequantized from, so its agreement with ONNX fp32 is reported too.

ONNX exports come from the model cache (`<cache>/onnx/`, written on first use: SmolLM2 takes about
a minute, Qwen2.5-Coder-0.5B several and a few GB of memory) or from --fp32-dir/--int8-dir.

    python -m bench onnx_drafter --models smollm2-135m-q4 --positions 200 --json bench/out/onnx.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.harness import add_common_args, load_prompts, table
from bench.lib import runner
from bench.lib.runner import Result, UsageError

MODELS = ("smollm2-135m-q4", "qwen2.5-coder-0.5b-q4")
LEVEL = 8  # rows of one tree level
# --backends name -> (label, registry name, options); the first one run is the agreement reference
BACKENDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "fp32": ("onnx fp32", "onnx", {"int8": False}),
    "int8": ("onnx int8", "onnx", {"int8": True}),
    "dynamic": ("onnx int8 (quantize_dynamic)", "onnx", {"int8": True}),
    "q4": ("llama.cpp Q4", "llama_cpp", {}),
}


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - float(x.max()))
    out: np.ndarray = e / e.sum()
    return out


def _decode(
    d: Any, prompts: list[list[int]], per_prompt: int, forced: list[list[int]] | None
) -> dict[str, Any]:
    """Plain decode steps: per prompt, `per_prompt` syncs of one more token (greedy, or `forced`).

    Returns the seconds spent in the timed syncs, the tokens that were fed, and every step's logits."""
    spent, steps, fed, rows = 0.0, 0, [], []
    for i, prompt in enumerate(prompts):
        s = list(prompt)
        logits = d.sync(s)  # the prefill is not a decode step: untimed
        path = []
        for j in range(per_prompt):
            rows.append(np.array(logits, dtype=np.float32))
            tok = forced[i][j] if forced is not None else int(np.argmax(logits))
            path.append(tok)
            s.append(tok)
            t0 = time.perf_counter()
            logits = d.sync(s)
            spent += time.perf_counter() - t0
            steps += 1
        fed.append(path)
    return {"seconds": spent, "steps": steps, "fed": fed, "logits": rows}


def _levels(d: Any, prompt: list[int], repeats: int) -> float:
    """Seconds per tree level of LEVEL rows (children of the committed end), median of `repeats`."""
    times = []
    for r in range(repeats):
        root = d.sync(prompt[: len(prompt) - (r % 2)])  # alternate so no level is a cache replay
        top = [int(t) for t in np.argsort(-root)[:LEVEL]]
        t0 = time.perf_counter()
        d.extend([-1] * LEVEL, top)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _agreement(ref: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    top1 = np.mean([int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(ref, got, strict=True)])
    tv = np.mean(
        [0.5 * float(np.abs(_softmax(a) - _softmax(b)).sum()) for a, b in zip(ref, got, strict=True)]
    )
    return float(top1), float(tv)


def bench_model(model: str, a: argparse.Namespace) -> list[dict[str, Any]]:
    from edge_client.drafters.registry import create_drafter

    backends = [BACKENDS[b] for b in a.backends.split(",") if b]
    dirs = {"fp32": a.fp32_dir, "int8": a.int8_dir, "dynamic": a.dynamic_dir}
    names = [b for b in a.backends.split(",") if b]
    rows: list[dict[str, Any]] = []
    ref_logits: list[np.ndarray] | None = None
    forced: list[list[int]] | None = None
    n_prompts = max(1, -(-a.positions // a.per_prompt))
    for name, (label, backend, opts) in zip(names, backends, strict=True):
        src = dirs.get(name) or model
        print(f"{model}: {label} ({src})", flush=True)
        d = create_drafter(backend, src, n_threads=1, max_context=2048, max_nodes=64, **opts)
        try:
            prompts = [d.tokenizer.encode(p.text) for p in load_prompts(n_prompts)]
            d.sync(prompts[0])  # warm up
            d.extend([-1] * LEVEL, list(range(LEVEL)))
            dec = _decode(d, prompts, a.per_prompt, forced)
            level_s = _levels(d, prompts[0], a.level_repeats)
        finally:
            d.close()
        row: dict[str, Any] = {
            "model": model,
            "backend": label,
            "decode_tok_s": dec["steps"] / dec["seconds"],
            "decode_ms": 1e3 * dec["seconds"] / dec["steps"],
            "level8_ms": 1e3 * level_s,
            "level8_tok_s": LEVEL / level_s,
            "positions": dec["steps"],
        }
        if ref_logits is None:
            ref_logits, forced = dec["logits"], dec["fed"]
            row.update(top1_vs_fp32=1.0, tv_vs_fp32=0.0)
        else:
            row["top1_vs_fp32"], row["tv_vs_fp32"] = _agreement(ref_logits, dec["logits"])
        rows.append(row)
        print(f"  {json.dumps({k: v for k, v in row.items() if k not in ('model', 'backend')})}", flush=True)
    return rows


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated draft aliases")
    ap.add_argument("--positions", type=int, default=200, help="decode positions per backend (agreement too)")
    ap.add_argument("--per-prompt", type=int, default=50, help="decode steps per prompt")
    ap.add_argument("--level-repeats", type=int, default=9, help="tree levels timed (median)")
    ap.add_argument("--fp32-dir", default=None, help="an fp32 export folder to use (one model only)")
    ap.add_argument("--int8-dir", default=None, help="an int8 export folder to use (one model only)")
    ap.add_argument(
        "--dynamic-dir",
        default=None,
        help="for the `dynamic` backend: a folder from `edge-client export-onnx --int8 --int8-method "
        "dynamic` (onnxruntime's quantize_dynamic; one model only, never made on first use)",
    )
    ap.add_argument(
        "--backends",
        default="fp32,int8,q4",
        help="comma-separated, of fp32 (onnx), int8 (onnx, 8-bit blocks), dynamic (onnx, quantize_dynamic: "
        "needs --dynamic-dir), q4 (llama.cpp); the first is the agreement reference (top-1 and TV are "
        "against it)",
    )
    add_common_args(ap, json=True, json_help="rows: one per model and backend")


def run(a: argparse.Namespace) -> Result:
    models = [m for m in a.models.split(",") if m]
    if (a.fp32_dir or a.int8_dir or a.dynamic_dir) and len(models) != 1:
        raise UsageError(
            "--fp32-dir/--int8-dir/--dynamic-dir name the export of ONE model: pass one --models"
        )
    if "dynamic" in a.backends.split(",") and not a.dynamic_dir:
        raise UsageError(
            "--backends dynamic needs --dynamic-dir (edge-client export-onnx --int8 --int8-method dynamic)"
        )
    if not a.backends or any(b not in BACKENDS for b in a.backends.split(",") if b):
        raise UsageError(f"--backends: a comma-separated list of {', '.join(BACKENDS)}")
    if a.positions < 1 or a.per_prompt < 1 or a.level_repeats < 1:
        raise UsageError("--positions, --per-prompt and --level-repeats must be positive")
    rows = [r for m in models for r in bench_model(m, a)]
    keys = ("model", "backend", "decode_tok_s", "level8_tok_s", "level8_ms", "top1_vs_fp32", "tv_vs_fp32")
    header = ["model", "backend", "decode tok/s", "level-8 tok/s", "level-8 ms", "top-1 vs fp32", "TV"]
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    return Result(
        rows,
        "\n" + table([[r[k] for k in keys] for r in rows], header),
        extra={"machine": machine, "load_average": os.getloadavg()},
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
