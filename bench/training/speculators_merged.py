"""`python -m bench speculators --parts merged`: SpecInfer's merged SSMs at equal nodes.

From a `draft-training boost` folder: SSM_1 (the recipe's trained draft) alone, SSM_1 merged with
the boosted SSM_2 (`ssm2/`) and SSM_1 merged with the independent SSM_2 (`indep2/`, the control),
each merge drafted in turn and in parallel, all at the same total nodes a round, against a verifier
of the recipe's teacher on the held-out prompts. bench.end_to_end.merged runs each pair (its variants `one`,
`merged`, `merged_parallel`); this adds the union top-1 on held-out records from the boost run's
boost.json. A SSM_2 without a GGUF is exported first (its draft.safetensors over the recipe's base
draft, as `draft-training export` writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.harness import table

# the boost folder's SSM_2 of each kind, and boost.json's union key for it
PAIRS = (("boosted", "ssm2", "union_top1"), ("independent", "indep2", "indep_union_top1"))
VARIANTS = ("ar", "one", "merged", "merged_parallel")


def ssm_gguf(run: Path, base_draft: str) -> Path:
    """`run`'s draft as a GGUF (run/draft.gguf), exported from its draft.safetensors when missing."""
    out = run / "draft.gguf"
    if out.is_file():
        return out
    from draft_training.distill import load_draft_weights
    from draft_training.export import export_gguf
    from edge_client.models import resolve_draft
    from shared.model import load_target

    weights = run / "draft.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{run} holds no draft.safetensors: run `draft-training boost` first")
    base = Path(resolve_draft(base_draft, progress=False))
    draft = load_target(str(base), progress=False)
    load_draft_weights(draft.model, weights)
    export_gguf(draft.model, base, out, "f32")
    return out


def merged_part(
    boost_dir: Path,
    teacher: str,
    ssm1: str,
    base_draft: str,
    prompt_file: Path | None,
    per_category: int,
    nodes: int,
    tokens: int,
    run_merged: Callable[[Sequence[str]], int] | None = None,
) -> list[dict[str, Any]]:
    """One row per pair (boosted, independent) and variant: tau, ms/token, nodes a round (below
    `nodes`: the trees' overlap), whether the tokens are `ar`'s, and the pair's union top-1."""
    from bench.end_to_end import merged

    doc = boost_dir / "boost.json"
    if not doc.is_file():
        raise FileNotFoundError(f"no {doc}: run `draft-training boost --out {boost_dir}` first")
    boost_rows = json.loads(doc.read_text(encoding="utf-8"))["rows"]
    first = next((r for r in boost_rows if r["ssm"] == 1), None)
    second = next((r for r in boost_rows if r["ssm"] == 2), None)
    if first is None or second is None:
        raise ValueError(f"{doc} has no SSM_2: boost with --m 2 or more")
    run = run_merged or merged.main
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="speculators-merged-") as tmp:
        prompts = prompt_file or _heldout_file(Path(tmp) / "heldout.jsonl", per_category)
        for pair, folder, union_key in PAIRS:
            gguf = ssm_gguf(boost_dir / folder, base_draft)
            out = Path(tmp) / f"{pair}.json"
            argv = [
                *("--model", teacher, "--draft", ssm1, "--draft", str(gguf), "--nodes", str(nodes)),
                *("--parallel", "--prompt-file", str(prompts), "--tokens", str(tokens), "--json", str(out)),
            ]
            saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
            try:
                code = run(argv)  # pins this process to the edge's cores
            finally:
                if saved is not None:  # the next pair's verifier gets its own core again
                    os.sched_setaffinity(0, saved)
            if code != 0:
                raise RuntimeError(f"bench.end_to_end.merged failed on the {pair} pair ({' '.join(argv)})")
            doc_rows = json.loads(out.read_text(encoding="utf-8"))
            rows += _pair_rows(doc_rows, pair, second.get(union_key), first.get("single_top1"))
    return rows


def _heldout_file(path: Path, per_category: int) -> Path:
    from draft_training.split import load_split, write_prompts

    write_prompts(path, load_split(), "heldout", per_category)
    return path


def _pair_rows(doc: dict[str, Any], pair: str, union: Any, alone: Any) -> list[dict[str, Any]]:
    same = doc.get("identical_to_ar", {})
    rows = []
    for r in doc["rows"]:
        if r["variant"] not in VARIANTS:
            continue
        merged = r["variant"].startswith("merged")
        rows.append(
            {
                "pair": pair,
                "variant": r["variant"],
                "tau": r.get("tau_pooled"),
                "ms_per_token": r.get("ms_per_token"),
                "nodes_per_round": r.get("nodes_per_round"),
                "identical_to_ar": same.get(r["variant"]) if r["variant"] != "ar" else None,
                # held-out top-1 of SSM_1 alone (`one`) or of either SSM (a merge), teacher-forced
                "union_top1": union if merged else alone if r["variant"] == "one" else None,
            }
        )
    return rows


def render_merged(rows: Sequence[dict[str, Any]], nodes: int) -> str:
    """The merged part's rows as the printed table, under its heading."""
    body = [
        [r["pair"], r["variant"], r["tau"], r["ms_per_token"], r["nodes_per_round"], r["identical_to_ar"],
         r["union_top1"]]
        for r in rows
    ]  # fmt: skip
    return f"\nmerged SSMs at {nodes} nodes a round (held-out prompts, greedy):\n" + table(
        body, ["SSM_2", "variant", "tau", "ms/token", "nodes/round", "= ar", "union top-1"]
    )


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--boost",
        type=Path,
        default=None,
        help="merged: a `draft-training boost` folder (ssm2/, indep2/, boost.json; default: the recipe's, "
        "under the draft_training cache)",
    )
    ap.add_argument("--nodes", type=int, default=8, help="merged: tree nodes a round in every variant")
