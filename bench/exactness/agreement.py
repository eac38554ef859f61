"""How often the target's token is among the draft's top-1..5, teacher-forced on the target's own
tokens (SpecInfer's Table 1, on our pair).

Teacher-forced on the target's own output: the target generates (greedy, and sampled at
temperature 1 with a seeded sampler) from each prompt; the draft then reads prompt + output in one
pass (a llama.cpp chain of the output tokens below the prompt) and, at every generated position,
the target's token is looked up in the draft's k most likely next tokens. SpecInfer reports the
same for LLaMA-7B / 68M drafts: at greedy decoding top-1 agreement of 68-79% across datasets and
top-5 of 87-97%. Per category (HumanEval raw, Spec-Bench categories) and overall.

    python -m bench agreement --humaneval 4 --prompts 12 --tokens 64 --json bench/out/agreement.json

The target's outputs cached once (`--records DIR`, repeatable): `draft-training collect` folders
(records of the target's tokens, greedy and at T 1; `make drafts` leaves its held-out ones in
`<cache>/draft_training/<alias>/heldout*`) are read instead of running the target, so every later
draft is measured on the same positions in seconds; the target is not loaded, and the records'
vocabulary must be the draft's.

    python -m bench agreement --records
    ~/.cache/treespec/draft_training/qwen2.5-coder-0.5b-kd/heldout \
        --records ~/.cache/treespec/draft_training/qwen2.5-coder-0.5b-kd/heldout_t1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.harness import BenchPrompt, add_common_args, suite_from_args, table
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

TOP_K = (1, 2, 3, 4, 5)


def target_output(target: Any, prompt: list[int], n: int, temperature: float, seed: int) -> list[int]:
    """The target's own continuation: greedy, or sampled at `temperature` with the verifier's sampler."""
    from cloud_verifier.sampling import SamplingParams, sample_next
    from shared.model import decode_step, prefill

    params = SamplingParams(temperature=temperature)
    kv = target.new_kv_cache(-(-(len(prompt) + n) // 16) + 2, 16)
    kv.add(0)
    out: list[int] = []
    eos = set(target.eos_ids)
    with torch.inference_mode():
        logits = prefill(target.model, kv, 0, prompt)
        while len(out) < n:
            tok = sample_next(logits, params, seed, len(prompt) + len(out))
            out.append(tok)
            if tok in eos:
                break
            (row,) = target.model.forward_packed([decode_step(0, tok, kv.cached_len(0))], kv)
            kv.commit_rows(0, [0])
            logits = row[0]
    return out


def draft_ranks(drafter: Any, prompt: list[int], output: list[int]) -> list[int]:
    """Per output position, the rank (0 = most likely) of the target's token in the draft's
    next-token logits there, teacher-forced."""
    first = drafter.sync(prompt)
    rows = [first]
    if len(output) > 1:
        chain = drafter.extend([-1, *range(len(output) - 2)], output[:-1])  # [len - 1, V]
        rows.extend(chain)
    ranks = []
    for logits, tok in zip(rows, output, strict=True):
        ranks.append(int((logits > logits[tok]).sum()))
    return ranks


def summarise(ranks: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    pooled: list[int] = []
    for cat, r in sorted(ranks.items()):
        arr = np.asarray(r)
        out[cat] = {f"top{k}": round(float((arr < k).mean()), 4) for k in TOP_K} | {"positions": len(r)}
        pooled += r
    arr = np.asarray(pooled)
    out["all"] = {f"top{k}": round(float((arr < k).mean()), 4) for k in TOP_K} | {"positions": len(pooled)}
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (raw)")
    ap.add_argument("--prompts", type=int, default=13, help="Spec-Bench dev prompts (one per category at 13)")
    add_model_args(
        ap,
        model=DEFAULT_TARGET,
        model_help="target alias or path",
        draft=DEFAULT_DRAFT,
        draft_help="draft alias or GGUF path (llama.cpp)",
        threads=0,
        threads_help="torch threads for the target (0: default)",
    )
    ap.add_argument(
        "--backend",
        choices=("llama_cpp", "onnx", "torch"),
        default="llama_cpp",
        help="the drafter backend that reads the output (torch also takes a target name such as tiny)",
    )
    ap.add_argument("--temperatures", default="0,1", help="target decoding: 0 greedy, else sampled")
    ap.add_argument(
        "--records",
        type=Path,
        action="append",
        default=[],
        help="a `draft-training collect` folder (repeatable): the target's outputs cached once, read "
        "instead of running the target (--model, --humaneval, --prompts, --prompt-file and --tokens "
        "are then unused; --temperatures still selects)",
    )
    add_common_args(
        ap,
        json=True,
        json_help="rows: one per temperature and category; temperatures: the same by temperature",
        tokens=64,
        tokens_help="target tokens per prompt",
        prompt_file=True,
        no_progress=True,
    )


def run(a: argparse.Namespace) -> Result:
    temps = [float(t) for t in a.temperatures.split(",") if t]
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.records:
        by_temp = cached_ranks(a, temps)
    else:
        by_temp = generated_ranks(a, temps)
    result: dict[str, Any] = {
        "config": vars(a) | {"records": [str(r) for r in a.records]},
        "temperatures": {},
    }
    for temp, ranks in by_temp.items():
        result["temperatures"][f"{temp:g}"] = summarise(ranks)
    source = ", ".join(str(r) for r in a.records) if a.records else a.model
    lines = []
    for t, cats in result["temperatures"].items():
        lines.append(f"\ntarget {'greedy' if t == '0' else f'sampled at T {t}'}: share of positions where "
                     f"its token is in the draft's top-k ({source} / {a.draft})")  # fmt: skip
        lines.append(
            table(
                [[c, *(f"{v[f'top{k}']:.3f}" for k in TOP_K), v["positions"]] for c, v in cats.items()],
                ["category", *(f"top-{k}" for k in TOP_K), "positions"],
            )
        )
    rows = [
        {"temperature": t, "category": c, **v}
        for t, cats in result["temperatures"].items()
        for c, v in cats.items()
    ]
    config = result.pop("config")
    return Result(rows, "\n".join(lines), extra=result, config=config)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


def _drafter(a: argparse.Namespace, context: int, output: int) -> Any:
    """The draft on --backend: `context` tokens of prompt at most, an output of `output` read as one chain."""
    from edge_client.drafters.registry import create_drafter

    return create_drafter(
        a.backend,
        a.draft,
        n_threads=a.threads or 2,
        max_nodes=max(256, output + 8),
        max_context=max(4096, context),
    )


def generated_ranks(a: argparse.Namespace, temps: list[float]) -> dict[float, dict[str, list[int]]]:
    """Ranks per temperature and category on the target's outputs, generated here."""
    from shared.model import load_target

    prompts: list[BenchPrompt] = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    target = load_target(a.model, progress=not a.no_progress)
    target.model.prepare(release=True)
    drafter = _drafter(a, 0, a.tokens)
    out: dict[float, dict[str, list[int]]] = {}
    bar = tqdm(total=len(prompts) * len(temps), desc="agreement", file=sys.stderr, disable=a.no_progress)
    try:
        for temp in temps:
            ranks = out.setdefault(temp, {})
            for i, p in enumerate(prompts):
                text = (
                    p.text
                    if p.raw
                    else target.tokenizer.apply_chat_template([{"role": "user", "content": p.text}])
                )
                ids = target.tokenizer.encode(text)
                tokens = target_output(target, ids, a.tokens, temp, seed=1000 + i)
                ranks.setdefault(p.category, []).extend(draft_ranks(drafter, ids, tokens))
                bar.update()
    finally:
        bar.close()
        drafter.close()
    return out


def cached_ranks(a: argparse.Namespace, temps: list[float]) -> dict[float, dict[str, list[int]]]:
    """Ranks per temperature and category on the target's outputs cached in collect folders."""
    import json

    from draft_training.collect import MANIFEST, load_positions

    fingerprints = {}
    for folder in a.records:
        path = folder / MANIFEST
        if not path.is_file():
            raise UsageError(
                f"--records {folder}: no {MANIFEST}; give a `draft-training collect --out` folder"
            )
        fingerprints[folder] = json.loads(path.read_text(encoding="utf-8")).get("vocab_fingerprint")
    try:
        records = [r for r in load_positions(a.records) if r["temperature"] in temps]
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(f"--records: {exc}") from None
    if not records:
        raise UsageError(f"--records: no record at --temperatures {a.temperatures}")
    drafter = _drafter(a, max(len(r["prompt"]) for r in records), max(len(r["tokens"]) for r in records))
    out: dict[float, dict[str, list[int]]] = {}
    try:
        mine = drafter.vocab_fingerprint()
        for folder, theirs in fingerprints.items():
            if theirs != mine:
                raise UsageError(
                    f"--records {folder}: its target's vocabulary (fingerprint {theirs}) is not the "
                    f"draft's ({a.draft}: {mine}); agreement needs the same token ids"
                )
        for r in tqdm(records, desc="agreement", file=sys.stderr, disable=a.no_progress):
            ranks = out.setdefault(r["temperature"], {})
            ranks.setdefault(r["category"], []).extend(draft_ranks(drafter, r["prompt"], r["tokens"]))
    finally:
        drafter.close()
    return dict(sorted(out.items()))


if __name__ == "__main__":
    sys.exit(main())
