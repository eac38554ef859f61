"""Greedy output of the quantized target (--weights quantized) against the fp32 target on the same
prompts: identical outputs, first divergence, teacher-forced token agreement.

How the verifier's quantized target decodes against its fp32 runtime: the two are different
targets numerically (int8 activations, the GGUF's blocks), and this says how different, greedy.

Per prompt, each target decodes greedily one token at a time (the target-only reference each
verifier mode is exact to), then:

- `identical`: the two outputs are equal; `first_divergence`: where they first differ (None when
  equal), with the fp32 target's top-2 logit gap there (`gap_at_divergence`: a small gap is a
  near-tie that any change of arithmetic may flip);
- `forced_agreement`: teacher-forced on the fp32 output, the share of positions where the
  quantized target's next token (argmax) is the fp32 target's token: the per-token agreement,
  free of the snowballing of a free-running comparison.

    python -m bench weights_agreement --humaneval 4 --prompts 4 --tokens 64 --json bench/out/wa.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from bench.harness import BenchPrompt, add_common_args, suite_from_args, table
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from shared.model_store import DEFAULT_TARGET


def greedy(target: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Target-only greedy decoding, one forward per token; the top-2 logit gap at every step."""
    from shared.model import decode_step, prefill

    kv = target.new_kv_cache(-(-(len(prompt) + n) // 16) + 2, 16)
    kv.add(0)
    out: list[int] = []
    gaps: list[float] = []
    eos = set(target.eos_ids)
    with torch.inference_mode():
        logits = prefill(target.model, kv, 0, prompt)
        while len(out) < n:
            top = torch.topk(logits.float(), 2).values
            gaps.append(float(top[0] - top[1]))
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok in eos:
                break
            (row,) = target.model.forward_packed([decode_step(0, tok, kv.cached_len(0))], kv)
            kv.commit_rows(0, [0])
            logits = row[0]
    return out, gaps


def forced(target: Any, prompt: list[int], tokens: list[int]) -> list[int]:
    """The target's argmax at every position of `tokens`, reading prompt + tokens one at a time."""
    from shared.model import decode_step, prefill

    kv = target.new_kv_cache(-(-(len(prompt) + len(tokens)) // 16) + 2, 16)
    kv.add(0)
    picks: list[int] = []
    with torch.inference_mode():
        logits = prefill(target.model, kv, 0, prompt)
        for i, tok in enumerate(tokens):
            picks.append(int(torch.argmax(logits)))
            if i + 1 == len(tokens):
                break
            (row,) = target.model.forward_packed([decode_step(0, tok, kv.cached_len(0))], kv)
            kv.commit_rows(0, [0])
            logits = row[0]
    return picks


def compare(prompt_ids: list[int], fp32: Any, quant: Any, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ref, gaps = greedy(fp32, prompt_ids, n)
    t1 = time.perf_counter()
    got, _ = greedy(quant, prompt_ids, n)
    t2 = time.perf_counter()
    picks = forced(quant, prompt_ids, ref)
    first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    if first is None and len(ref) != len(got):
        first = min(len(ref), len(got))
    return {
        "prompt_tokens": len(prompt_ids),
        "tokens": len(ref),
        "identical": ref == got,
        "first_divergence": first,
        "gap_at_divergence": round(gaps[first], 4) if first is not None and first < len(gaps) else None,
        "forced_agreement": round(sum(a == b for a, b in zip(picks, ref, strict=True)) / len(ref), 4),
        "fp32_ms_per_token": round((t1 - t0) * 1e3 / len(ref), 1),
        "quantized_ms_per_token": round((t2 - t1) * 1e3 / max(1, len(got)), 1),
        "fp32_tokens": ref,
        "quantized_tokens": got,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(ap, model=DEFAULT_TARGET, model_help="target alias or GGUF path", threads=0)
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (raw)")
    ap.add_argument("--prompts", type=int, default=4, help="Spec-Bench dev prompts (chat template)")
    add_common_args(
        ap,
        json=True,
        json_help="rows: one per prompt; summary: identical prompts, median forced agreement",
        tokens=64,
        tokens_help="greedy tokens per prompt",
        prompt_file=True,
        no_progress=True,
    )


def run(a: argparse.Namespace) -> Result:
    if a.tokens < 1:
        raise UsageError("--tokens must be >= 1")
    prompts: list[BenchPrompt] = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    from shared.model import load_target

    if a.threads:
        torch.set_num_threads(a.threads)
    fp32 = load_target(a.model, progress=not a.no_progress)
    fp32.model.prepare(release=True)
    quant = load_target(a.model, progress=not a.no_progress, weights="quantized")
    rows: list[dict[str, Any]] = []
    for p in tqdm(prompts, desc="weights agreement", file=sys.stderr, disable=a.no_progress):
        text = p.text if p.raw else fp32.tokenizer.apply_chat_template([{"role": "user", "content": p.text}])
        ids = fp32.tokenizer.encode(text)
        rows.append({"prompt": p.question_id, "category": p.category, **compare(ids, fp32, quant, a.tokens)})
    shown = table(
        [
            [
                r["prompt"],
                r["tokens"],
                "yes" if r["identical"] else "no",
                "-" if r["first_divergence"] is None else r["first_divergence"],
                "-" if r["gap_at_divergence"] is None else r["gap_at_divergence"],
                f"{r['forced_agreement']:.3f}",
            ]
            for r in rows
        ],
        ["prompt", "tokens", "identical", "first divergence", "fp32 top-2 gap there", "forced agreement"],
    )
    positions = sum(r["tokens"] for r in rows)
    agree = sum(r["forced_agreement"] * r["tokens"] for r in rows) / positions
    summary = {
        "prompts": len(rows),
        "identical_prompts": sum(r["identical"] for r in rows),
        "forced_agreement_pooled": round(agree, 4),
        "forced_agreement_median": round(statistics.median(r["forced_agreement"] for r in rows), 4),
        "median_first_divergence": statistics.median(
            r["first_divergence"] if r["first_divergence"] is not None else r["tokens"] for r in rows
        ),
    }
    shown += (
        f"\n{a.model}: {summary['identical_prompts']}/{len(rows)} outputs identical; teacher-forced "
        f"agreement {agree:.3f} over {positions} positions"
    )
    return Result(rows, shown, extra={"summary": summary, "model": a.model})


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
