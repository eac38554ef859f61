"""Trained drafts before and after, on held-out prompts (SpecInfer's Table 1 analog): top-1..5
coverage of the teacher's tokens by each draft on held-out records, with Wilson intervals and McNemar
against the first draft, the learning curve, and (--parts e2e) tau and ms/token end to end.

The positions are those of `draft-training collect` records of held-out prompts (the teacher's own
continuations, greedy and at T 1; `make drafts` collects both into its work folder). Each draft
reads prompt + continuation teacher-forced (bench.exactness.agreement.draft_ranks) and at every position the
rank of the teacher's token among the draft's next tokens is kept. Per draft and backend (the shipped
artefact in llama.cpp; the fp32 torch model, to separate training from quantization), temperature
and category: top-1..5 coverage, n, and the Wilson 95% interval of top-1. Each draft after the first
is compared with the first on top-1 by McNemar's exact test on the paired positions (b: only the
first right, c: only the other right; two-sided binomial p of min(b, c) in b + c at 1/2).

With `--curve RUN` (a distill run folder, or a trained draft's `<file>.json`): the learning curve,
held-out top-1 and simulated tau against training tokens.

With `--parts ...,e2e`: every draft end to end against the recipe's teacher served by a verifier
(bench.end_to_end.e2e's modes, greedy, `--e2e-modes`, default ar,tree,budget) on held-out prompts (the first
`--per-category` of each category of the committed split, or `--prompt-file`): tau, ms/token, the
speed-up over `ar` and whether the tokens are `ar`'s. `ar` runs again beside each draft, prompt by
prompt interleaved with its modes, so each draft's speed-up is measured in the same minutes.

    python -m bench speculators --drafts smollm2-135m-q4-l8,smollm2-135m-l8-kd --json out.json
    python -m bench speculators --recipe qwen2.5-coder-0.5b-kd --json out.json   (the Qwen pilot)
    python -m bench speculators --parts e2e --tokens 64 --json out.json    (tau and ms/token only)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.exactness.agreement import TOP_K, draft_ranks
from bench.harness import BenchPrompt, add_common_args, suite_from_args, table
from bench.lib import runner
from bench.lib.runner import Result, UsageError
from bench.training import speculators_merged

DEFAULT_RECIPE = "smollm2-135m-l8-kd"


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
    """Held-out top-1 and simulated tau by step and the teacher tokens trained on, from a distill
    run's train.json or a trained draft's .json. The tokens are counted (`train_tokens_counted`):
    from the evaluations when the run counted them, else from the run's records and seed when they are
    on this machine; otherwise estimated as steps x batch x the recipe's tokens a record (an upper
    bound: records that end at EOS are shorter)."""
    doc_path = path / "train.json" if path.is_dir() else path
    doc = json.loads(doc_path.read_text(encoding="utf-8"))
    evals = doc.get("evals", [])
    if "recipe" in doc:  # make drafts' summary
        batch, tokens = doc["recipe"]["batch"], doc["recipe"]["tokens"]
        run = _recipe_run(doc["recipe"]["alias"])
    else:
        batch, tokens = doc["distill"]["batch"], doc["records_manifest"]["tokens"]
        run = doc
    steps = [e["step"] for e in evals]
    counted = None if all("train_positions" in e for e in evals) else _counted_positions(run, steps)
    rows = []
    for e in evals:
        n = e.get("train_positions", None if counted is None else counted[e["step"]])
        rows.append(
            {
                "step": e["step"],
                "train_tokens": e["step"] * batch * tokens if n is None else n,
                "train_tokens_counted": n is not None,
                "top1": e["top1"],
                "tau": e["tau"],
            }
        )
    return rows


def _recipe_run(alias: str) -> dict[str, Any] | None:
    """The train.json of the distill run `make drafts` made for `alias`, when it is on this machine."""
    from draft_training.drafts import work_dir

    path = work_dir(alias) / "run" / "train.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _counted_positions(run: dict[str, Any] | None, steps: list[int]) -> dict[int, int] | None:
    """Teacher positions trained on before each step, replayed from a run's records and settings
    (None when the records are not here, or the run trained on boosting's weighted records)."""
    from draft_training.distill import load_examples, positions_by_step, split_validation

    if run is None or "weights_sha256" in run or not Path(run.get("records") or "-").is_dir():
        return None
    d = run["distill"]
    train = load_examples(Path(run["records"]), d.get("max_positions", 0))
    train, _ = split_validation(train, d.get("validation", 0.0))
    return positions_by_step(train, steps, d["batch"], d["seed"])


def default_records(recipe: str = DEFAULT_RECIPE) -> list[Path]:
    """The held-out records `make drafts` collected for `recipe` (greedy, then T 1)."""
    from draft_training.drafts import work_dir

    work = work_dir(recipe)
    return [p for p in (work / "heldout", work / "heldout_t1") if p.is_dir()]


PARTS = ("table1", "e2e", "merged")
E2E_MODES = "ar,tree,budget"


def add_args(ap: argparse.ArgumentParser) -> None:
    from edge_client.drafters.registry import backend_choices

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
        "held-out records, its teacher (the e2e part's verifier) and, unless --drafts, its base draft "
        "against the trained alias",
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
    ap.add_argument(
        "--parts",
        default="table1",
        help="comma-separated: table1 (coverage from the records, with the curve), e2e (tau and ms/token "
        "of each draft against a verifier of the recipe's teacher) and merged (SSM_1 alone and merged with "
        "the boosted or the independent SSM_2 at equal nodes, in turn and in parallel: --boost, --nodes)",
    )
    ap.add_argument(
        "--e2e-modes",
        default=E2E_MODES,
        help="e2e: the modes, as bench.end_to_end.e2e names them (ar among them)",
    )
    ap.add_argument(
        "--e2e-backend",
        default="llama_cpp",
        choices=backend_choices(),
        help="e2e: the drafter backend (default: llama.cpp, the shipped GGUF)",
    )
    ap.add_argument(
        "--per-category",
        type=int,
        default=1,
        help="e2e: the first N held-out prompts of each category of the committed split (0: all)",
    )
    ap.add_argument(
        "--tree", default=None, help="e2e: the tree modes' expansion (default: the first draft's recommended)"
    )
    speculators_merged.add_args(ap)
    add_common_args(
        ap, json=True, json_help="rows: coverage per draft, backend, T and category; comparisons; "
        "learning_curve; e2e (per draft and mode: tau, ms_per_token, speedup_vs_ar, identical_to_ar); "
        "merged (per SSM_2 and variant: tau, ms_per_token, nodes_per_round, identical_to_ar, union_top1)",
        tokens=64, tokens_help="e2e and merged: new tokens per prompt", prompt_file=True, no_progress=True,
    )  # fmt: skip


def run(a: argparse.Namespace) -> Result:
    from draft_training.collect import load_positions
    from draft_training.drafts import RECIPES

    if a.recipe not in RECIPES:
        raise UsageError(f"--recipe: no recipe {a.recipe!r}; recipes: {', '.join(RECIPES)}")
    parts = [p for p in a.parts.split(",") if p]
    if not parts or any(p not in PARTS for p in parts):
        raise UsageError(f"--parts: choose from {','.join(PARTS)}, got {a.parts!r}")
    drafts = [d for d in (a.drafts or f"{RECIPES[a.recipe].draft},{a.recipe}").split(",") if d]
    rows: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    if "table1" in parts:
        folders = a.records or default_records(a.recipe)
        if not folders:
            raise UsageError(f"no held-out records: run `make drafts` ({a.recipe}) first or give --records")
        rows, comparisons = coverage_part(load_positions(folders), drafts, a.backends, a.no_progress)
    e2e: list[dict[str, Any]] = []
    if "e2e" in parts:
        modes = [m for m in a.e2e_modes.split(",") if m]
        if "ar" not in modes:
            raise UsageError("--e2e-modes: include ar (the speed-up's and the exactness's reference)")
        prompts = suite_from_args(0, 0, a.prompt_file) if a.prompt_file else heldout_prompts(a.per_category)
        e2e = e2e_part(RECIPES[a.recipe].teacher, drafts, prompts, modes, a)
    merged = _merged(a, parts)
    curve = learning_curve(a.curve) if a.curve else []
    text = [render_coverage(rows, comparisons, curve)] if rows or curve else []
    text += [render_e2e(e2e)] if e2e else []
    text += [speculators_merged.render_merged(merged, a.nodes)] if merged else []
    extra: dict[str, object] = {
        "comparisons": comparisons,
        "learning_curve": curve,
        "e2e": e2e,
        "merged": merged,
    }
    return Result(rows, "\n".join(text), extra=extra)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


def _merged(a: argparse.Namespace, parts: list[str]) -> list[dict[str, Any]]:
    from draft_training.drafts import RECIPES, work_dir

    if "merged" not in parts:
        return []
    if a.nodes < 2:
        raise UsageError(f"--nodes: at least 2 (one per merged draft), got {a.nodes}")
    recipe = RECIPES[a.recipe]
    boost_dir = a.boost or work_dir(a.recipe) / "boost"
    try:
        return speculators_merged.merged_part(
            boost_dir, recipe.teacher, a.recipe, recipe.draft,
            a.prompt_file, a.per_category, a.nodes, a.tokens,
        )  # fmt: skip
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(f"--parts merged: {exc}") from None


def coverage_part(
    records: list[dict[str, Any]], drafts: list[str], backends_text: str, no_progress: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Table 1's rows (coverage per draft, backend, T and category) and the McNemar comparisons."""
    backends = [b for b in backends_text.split(",") if b]
    longest = max(len(r["prompt"]) + len(r["tokens"]) for r in records)
    rows: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    bar = tqdm(total=len(drafts) * len(backends) * len(records), desc="speculators", file=sys.stderr,
               disable=no_progress)  # fmt: skip
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
    return rows, comparisons


def heldout_prompts(per_category: int) -> list[BenchPrompt]:
    """The committed split's held-out prompts, the first `per_category` of each category (0: all)."""
    from draft_training.split import first_per_category, load_split

    return first_per_category(load_split().prompts("heldout"), per_category)


def e2e_part(
    teacher: str, drafts: list[str], prompts: Sequence[BenchPrompt], modes: list[str], a: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each draft end to end against a verifier of `teacher` (started here, on its own cores), greedy:
    one row per draft and mode (tau, ms/token, the speed-up over this draft's own `ar` and whether
    every mode's tokens are `ar`'s). The edge's cores are given back afterwards."""
    from bench.harness import CoreSplit, Verifier
    from edge_client.defaults import recommended_tree

    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    tree_text = a.tree or recommended_tree(drafts[0].partition("@lora=")[0])
    verifier = Verifier(teacher, cores=split.verifier, threads=len(split.verifier)).start()
    saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    split.pin_edge()
    rows: list[dict[str, Any]] = []
    try:
        for i, draft in enumerate(drafts):
            print(f"e2e: draft {i + 1}/{len(drafts)} {draft}, modes {','.join(modes)}", file=sys.stderr)
            rows += _e2e_draft(verifier, draft, prompts, modes, tree_text, a)
    finally:
        verifier.stop()
        if saved is not None:
            os.sched_setaffinity(0, saved)
    return rows


def _e2e_draft(
    verifier: Any, draft: str, prompts: Sequence[BenchPrompt], modes: list[str], tree_text: str,
    a: argparse.Namespace,
) -> list[dict[str, Any]]:  # fmt: skip
    import asyncio

    from bench.end_to_end.e2e import run_modes
    from bench.end_to_end.e2e_results import report
    from edge_client.drafters.registry import create_drafter
    from shared.messages import Mode
    from shared.tree import ExpansionConfig

    model, _, lora = draft.partition("@lora=")
    if lora and a.e2e_backend != "llama_cpp":
        raise SystemExit(f"--drafts {draft}: a LoRA adapter runs in llama.cpp only (--e2e-backend llama_cpp)")
    drafter = create_drafter(a.e2e_backend, model, n_threads=1, **({"lora": lora} if lora else {}))
    try:
        runs, by_cat = asyncio.run(
            run_modes(
                verifier.url, drafter, prompts, a.tokens, 0.0, Mode.GREEDY, ExpansionConfig.parse(tree_text),
                verifier.forwards, modes=modes, progress=not a.no_progress,
            )
        )  # fmt: skip
    finally:
        drafter.close()
    res = report(runs, by_cat, True)
    ar_ms = res["modes"]["ar"]["ms_per_token"]
    return [
        {
            "draft": draft,
            "mode": m,
            "tree": tree_text,
            "prompts": len(prompts),
            "tokens": a.tokens,
            "tau": s["tau"],
            "tau_pooled": s["tau_pooled"],
            "ms_per_token": s["ms_per_token"],
            "target_forwards_per_token": s["target_forwards_per_token"],
            "speedup_vs_ar": round(ar_ms / s["ms_per_token"], 3) if s["ms_per_token"] else None,
            "identical_to_ar": res["identical_to_ar"],
            "tau_by_category": s["tau_by_category"],
        }
        for m, s in res["modes"].items()
    ]


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


def render_coverage(
    rows: list[dict[str, Any]], comparisons: list[dict[str, Any]], curve: list[dict[str, Any]]
) -> str:
    """Table 1 (coverage per draft, backend, T and category), the McNemar comparisons and the
    learning curve, as printed."""
    out = [
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
    ]
    if comparisons:
        out.append("\ntop-1 against the first draft (McNemar, exact):")
        out.append(
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
        out.append("\nlearning curve (held-out, teacher-forced):")
        out.append(
            table(
                [[c["step"], _tokens_cell(c), c["top1"], c["tau"]] for c in curve],
                ["step", "train tokens (~: estimated)", "top-1", "tau"],
            )
        )
    return "\n".join(out)


def _tokens_cell(c: dict[str, Any]) -> str:
    return str(c["train_tokens"]) if c.get("train_tokens_counted") else f"~{c['train_tokens']}"


def render_e2e(rows: list[dict[str, Any]]) -> str:
    """The e2e part's rows as printed, under the setting they ran in."""
    r0 = rows[0]
    return (
        f"\nend to end, greedy, {r0['prompts']} held-out prompts x {r0['tokens']} tokens, "
        f"tree {r0['tree']}:\n"
        + table(
            [
                [r["draft"], r["mode"], r["tau"], r["ms_per_token"], r["speedup_vs_ar"], r["identical_to_ar"]]
                for r in rows
            ],
            ["draft", "mode", "tau", "ms/token", "speed-up vs ar", "tokens = ar's"],
        )
    )


if __name__ == "__main__":
    sys.exit(main())
