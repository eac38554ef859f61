"""Trained drafts before and after, on held-out prompts (SpecInfer's Table 1 analog).

The positions are those of `draft-training collect` records of held-out prompts (the teacher's own
continuations, greedy and at T 1; `make drafts` collects both into its work folder). Each draft
reads prompt + continuation teacher-forced (bench.agreement.draft_ranks) and at every position the
rank of the teacher's token among the draft's next tokens is kept. Per draft and backend (the shipped
artefact in llama.cpp; the fp32 torch model, to separate training from quantization), temperature
and category: top-1..5 coverage, n, and the Wilson 95% interval of top-1. Each draft after the first
is compared with the first on top-1 by McNemar's exact test on the paired positions (b: only the
first right, c: only the other right; two-sided binomial p of min(b, c) in b + c at 1/2).

With `--curve RUN` (a distill run folder, or a trained draft's `<file>.json`): the learning curve,
held-out top-1 and simulated tau against training tokens.

    python -m bench.speculators --drafts smollm2-135m-q4-l8,smollm2-135m-l8-kd --json out.json
    python -m bench.speculators --recipe qwen2.5-coder-0.5b-kd --json out.json   (the Qwen pilot)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.agreement import TOP_K, draft_ranks
from bench.harness import add_common_args, table, write_result

DEFAULT_RECIPE = "smollm2-135m-l8-kd"
_NAME = re.compile(r"^(?P<category>.+?)__(?P<id>.+)__t(?P<t>[0-9.]+)$")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: P(min(b, c) or fewer of b + c fair coin flips, twice)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, float(Fraction(2 * tail, 2**n)))  # exact: 2**n overflows a float past n = 1023


def load_positions(folders: Sequence[Path]) -> list[dict[str, Any]]:
    """Every record of the collect folders: name, category, temperature, prompt and tokens."""
    from draft_training.collect import RECORDS, read_record

    out = []
    for folder in folders:
        paths = sorted(p for p in (folder / RECORDS).glob("*.npz") if not p.name.startswith("."))
        if not paths:
            raise FileNotFoundError(
                f"no records in {folder / RECORDS}: run `make drafts` or `draft-training collect`"
            )
        for path in paths:
            m = _NAME.match(path.stem)
            if m is None:
                raise ValueError(f"{path}: not a collect record name (<category>__<id>__t<T>)")
            r = read_record(path)
            out.append(
                {
                    "name": path.stem,
                    "category": m["category"],
                    "temperature": float(m["t"]),
                    "prompt": r["prompt"].tolist(),
                    "tokens": r["tokens"].tolist(),
                }
            )
    return out


def coverage(ranks: np.ndarray) -> dict[str, Any]:
    n = int(ranks.size)
    hits = int((ranks < 1).sum())
    lo, hi = wilson(hits, n)
    return {f"top{k}": round(float((ranks < k).mean()), 4) if n else 0.0 for k in TOP_K} | {
        "n": n,
        "top1_lo": round(lo, 4),
        "top1_hi": round(hi, 4),
    }


def table1(records: Sequence[dict[str, Any]], ranks: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Coverage rows per temperature and category (and "all") of one draft's ranks (by record)."""
    rows = []
    for temp in sorted({r["temperature"] for r in records}):
        mine = [r for r in records if r["temperature"] == temp]
        cats = sorted({r["category"] for r in mine})
        for cat in [*cats, "all"]:
            sel = [ranks[r["name"]] for r in mine if cat in ("all", r["category"])]
            rows.append({"temperature": temp, "category": cat, **coverage(np.concatenate(sel))})
    return rows


def compare(
    records: Sequence[dict[str, Any]], base: dict[str, np.ndarray], other: dict[str, np.ndarray]
) -> list[dict[str, Any]]:
    """McNemar on top-1, per temperature (all categories pooled)."""
    rows = []
    for temp in sorted({r["temperature"] for r in records}):
        names = [r["name"] for r in records if r["temperature"] == temp]
        a = np.concatenate([base[n] < 1 for n in names])
        b = np.concatenate([other[n] < 1 for n in names])
        only_base, only_other = int((a & ~b).sum()), int((~a & b).sum())
        rows.append(
            {
                "temperature": temp,
                "n": int(a.size),
                "top1_base": round(float(a.mean()), 4),
                "top1_other": round(float(b.mean()), 4),
                "points": round(100 * float(b.mean() - a.mean()), 2),
                "only_base": only_base,
                "only_other": only_other,
                "p": mcnemar(only_base, only_other),
            }
        )
    return rows


def learning_curve(path: Path) -> list[dict[str, Any]]:
    """Held-out top-1 and simulated tau by step and training tokens, from a distill run's train.json
    or a trained draft's .json."""
    doc_path = path / "train.json" if path.is_dir() else path
    doc = json.loads(doc_path.read_text(encoding="utf-8"))
    evals = doc.get("evals", [])
    if "recipe" in doc:  # make drafts' summary
        batch, tokens = doc["recipe"]["batch"], doc["recipe"]["tokens"]
    else:
        batch, tokens = doc["distill"]["batch"], doc["records_manifest"]["tokens"]
    return [
        {"step": e["step"], "train_tokens": e["step"] * batch * tokens, "top1": e["top1"], "tau": e["tau"]}
        for e in evals
    ]


def default_records(recipe: str = DEFAULT_RECIPE) -> list[Path]:
    """The held-out records `make drafts` collected for `recipe` (greedy, then T 1)."""
    from draft_training.drafts import work_dir

    work = work_dir(recipe)
    return [p for p in (work / "heldout", work / "heldout_t1") if p.is_dir()]


def main(argv: Sequence[str] | None = None) -> int:
    from edge_client.drafters.registry import backend_choices

    ap = argparse.ArgumentParser(
        prog="python -m bench.speculators",
        description="Top-1..5 coverage of the teacher's tokens by each draft on held-out records, with "
        "Wilson intervals and McNemar against the first draft, and the learning curve (issue 34's Table 1).",
    )
    ap.add_argument(
        "--records",
        type=Path,
        action="append",
        default=None,
        help="a collect folder of held-out records (repeatable; default: those make drafts collected)",
    )
    ap.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help="a `make drafts` recipe (smollm2-135m-l8-kd, or the Qwen pilot qwen2.5-coder-0.5b-kd): its "
        "held-out records and, unless --drafts, its base draft against the trained alias",
    )
    ap.add_argument(
        "--drafts",
        default=None,
        help="comma-separated drafts (aliases or GGUF paths), the first the baseline (default: the recipe's "
        "base draft, then the trained alias); DRAFT@lora=FILE applies a LoRA adapter GGUF to DRAFT "
        "(llama.cpp only: skipped on the other backends)",
    )
    ap.add_argument(
        "--backends",
        default="llama_cpp,torch",
        help=f"comma-separated drafter backends ({', '.join(backend_choices())}): the shipped artefact in "
        "llama.cpp, the fp32 model in torch",
    )
    ap.add_argument(
        "--curve", type=Path, default=None, help="a distill run folder or a trained draft's .json"
    )
    add_common_args(
        ap, json=True, json_help="rows: coverage per draft, backend, T and category; comparisons; "
        "learning_curve", no_progress=True,
    )  # fmt: skip
    a = ap.parse_args(argv)
    from draft_training.drafts import RECIPES

    if a.recipe not in RECIPES:
        ap.error(f"--recipe: no recipe {a.recipe!r}; recipes: {', '.join(RECIPES)}")
    folders = a.records or default_records(a.recipe)
    if not folders:
        ap.error(f"no held-out records: run `make drafts` ({a.recipe}) first or give --records")
    records = load_positions(folders)
    drafts = [d for d in (a.drafts or f"{RECIPES[a.recipe].draft},{a.recipe}").split(",") if d]
    backends = [b for b in a.backends.split(",") if b]
    longest = max(len(r["prompt"]) + len(r["tokens"]) for r in records)
    rows: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    bar = tqdm(total=len(drafts) * len(backends) * len(records), desc="speculators", file=sys.stderr,
               disable=a.no_progress)  # fmt: skip
    for backend in backends:
        by_draft: dict[str, dict[str, np.ndarray]] = {}
        for draft in drafts:
            ranks = _ranks(backend, draft, records, longest, bar)
            if ranks is not None:
                by_draft[draft] = ranks
                rows += [{"draft": draft, "backend": backend, **row} for row in table1(records, ranks)]
        for draft in (d for d in drafts[1:] if d in by_draft and drafts[0] in by_draft):
            comparisons += [
                {"backend": backend, "base": drafts[0], "draft": draft, **c}
                for c in compare(records, by_draft[drafts[0]], by_draft[draft])
            ]
    bar.close()
    curve = learning_curve(a.curve) if a.curve else []
    _print(rows, comparisons, curve)
    write_result(a.json, a, rows, True, comparisons=comparisons, learning_curve=curve)
    return 0


def _ranks(
    backend: str, draft: str, records: list[dict[str, Any]], longest: int, bar: Any
) -> dict[str, np.ndarray] | None:
    """The rank of the teacher's token at every position of every record for one draft on one
    backend; None where DRAFT@lora=FILE meets a backend other than llama.cpp (skipped)."""
    from edge_client.drafters.registry import create_drafter

    model, _, lora = draft.partition("@lora=")
    if lora and backend != "llama_cpp":
        bar.update(len(records))
        return None
    extra = {"lora": lora} if lora else {}
    drafter = create_drafter(backend, model, max_context=longest + 16, max_nodes=max(256, longest), **extra)
    ranks: dict[str, np.ndarray] = {}
    try:
        for r in records:
            ranks[r["name"]] = np.asarray(draft_ranks(drafter, r["prompt"], r["tokens"]))
            bar.update()
    finally:
        drafter.close()
    return ranks


def _print(
    rows: list[dict[str, Any]], comparisons: list[dict[str, Any]], curve: list[dict[str, Any]]
) -> None:
    print(
        table(
            [
                [
                    r["draft"],
                    r["backend"],
                    f"{r['temperature']:g}",
                    r["category"],
                    *(r[f"top{k}"] for k in TOP_K),
                    f"[{r['top1_lo']:.3f}, {r['top1_hi']:.3f}]",
                    r["n"],
                ]
                for r in rows
            ],
            ["draft", "backend", "T", "category", *(f"top-{k}" for k in TOP_K), "top-1 95% CI", "n"],
        )
    )
    if comparisons:
        print("\ntop-1 against the first draft (McNemar, exact):")
        print(
            table(
                [
                    [
                        c["draft"],
                        c["backend"],
                        f"{c['temperature']:g}",
                        c["top1_base"],
                        c["top1_other"],
                        f"{c['points']:+.2f}",
                        c["only_base"],
                        c["only_other"],
                        f"{c['p']:.2g}",
                        c["n"],
                    ]
                    for c in comparisons
                ],
                ["draft", "backend", "T", "base", "draft", "points", "only base", "only draft", "p", "n"],
            )
        )
    if curve:
        print("\nlearning curve (held-out, teacher-forced):")
        print(
            table(
                [[c["step"], c["train_tokens"], c["top1"], c["tau"]] for c in curve],
                ["step", "train tokens", "top-1", "tau"],
            )
        )


if __name__ == "__main__":
    sys.exit(main())
