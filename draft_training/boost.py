"""`boost`: SpecInfer's collective boost-tuning, adapted to the unit of acceptance.

SSM_1 is a distilled draft (a `distill` run). SSM_{j+1} is trained from the same base draft, on the
same records, with each train position weighted by whether the SSMs so far already cover it (one
of them, teacher-forced, predicts the teacher's token as its top-1), so it learns what the others
miss. Their drafts are then merged into one tree (edge_client.trees.merged).

Criteria (`--criterion`):

- `token` (default): weight 0 on covered positions, 1 on the others;
- `window:N`: positions in windows of N (from each record's start) that the SSMs would accept
  whole (every position covered) get weight 0, the rest 1;
- `sequence`: the paper's rule: a record every position of which is covered is dropped, the
  others kept whole. On long records this filters almost nothing (0.86^128 ~ 4e-9).

The control (`--control`) trains the same number of SSMs independently: the same steps, unweighted,
each with its own seed. Boosting stops at `m` SSMs, or earlier when an SSM adds less than
`min_gain` (1 point) of union top-1 on the held-out records.

Layout of the output folder: `ssm<j>/` (distill runs, each with draft.safetensors; ssm1 is a copy
of the given run's weights), `indep<j>/` for the control, and `boost.json`: per j, the single and
union held-out top-1 of the boosted and the independent SSMs, and the share of weighted positions.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draft_training.distill import DistillConfig, Example, distill, load_examples, save_draft
from draft_training.student import Student

BOOST_FILE = "boost.json"


def parse_criterion(text: str) -> tuple[str, int]:
    """'token' | 'sequence' | 'window:N' -> (kind, N); ValueError naming the bad value."""
    if text in ("token", "sequence"):
        return text, 0
    kind, _, n = text.partition(":")
    if kind == "window" and n.isdigit() and int(n) >= 1:
        return "window", int(n)
    raise ValueError(f"--criterion must be token, sequence or window:N (N >= 1), got {text!r}")


def position_weights(covered: Sequence[np.ndarray], criterion: str) -> list[np.ndarray]:
    """Per train record, the weight of each position given which ones the SSMs so far cover."""
    kind, n = parse_criterion(criterion)
    out = []
    for c in covered:
        c = np.asarray(c, dtype=bool)
        if kind == "token":
            w = (~c).astype(np.float32)
        elif kind == "sequence":
            w = np.full(c.shape, 0.0 if c.all() else 1.0, dtype=np.float32)
        else:
            w = np.ones(c.shape, dtype=np.float32)
            for a in range(0, c.size, n):
                if c[a : a + n].all():
                    w[a : a + n] = 0.0
        out.append(w)
    return out


@torch.no_grad()
def top1_hits(student: Student, examples: Sequence[Example]) -> list[np.ndarray]:
    """Per example, whether the student's top-1 is the teacher's token at each position."""
    return [
        (student(ex.tokens, ex.start)[: len(ex.target)].argmax(-1) == ex.target).numpy() for ex in examples
    ]


def _union(hits: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    return [np.logical_or.reduce(list(per)) for per in zip(*hits, strict=True)]


def _rate(hits: Sequence[np.ndarray]) -> float:
    n = sum(h.size for h in hits)
    return round(float(sum(int(h.sum()) for h in hits)) / max(1, n), 4)


def boost(
    out: Path,
    records: Path,
    heldout: Path,
    ssm1: Path,
    make_student: Callable[[Path | None], Student],
    config: DistillConfig,
    *,
    m: int = 3,
    criterion: str = "token",
    control: bool = True,
    min_gain: float = 0.01,
    progress: bool = True,
) -> dict[str, Any]:
    """Boost SSM_2..m after SSM_1 (`ssm1`: a draft.safetensors); `make_student(weights)` gives the
    base draft as a Student, with those trained weights loaded (None: the base itself). Every
    distill run resumes. The summary, also written to out/boost.json."""
    parse_criterion(criterion)
    if m < 2:
        raise ValueError(f"--m must be at least 2 (SSM_1 is given), got {m}")
    if not ssm1.is_file():
        raise FileNotFoundError(f"{ssm1} does not exist: give a distill run's draft.safetensors as SSM_1")
    out.mkdir(parents=True, exist_ok=True)
    first = out / "ssm1" / "draft.safetensors"
    first.parent.mkdir(exist_ok=True)
    if not first.exists():
        shutil.copyfile(ssm1, first)
    vocab = make_student(None).model.config.vocab_size
    train = load_examples(records, config.max_positions, vocab)
    held = load_examples(heldout, config.max_positions, vocab)
    s1 = make_student(first)
    boosted_train, boosted_held = [top1_hits(s1, train)], [top1_hits(s1, held)]
    indep_held = [boosted_held[0]]
    one = _rate(boosted_held[0])
    rows: list[dict[str, Any]] = [{"ssm": 1, "single_top1": one, "union_top1": one}]
    for j in range(2, m + 1):
        weights = position_weights(_union(boosted_train), criterion)
        share = round(float(sum(w.sum() for w in weights)) / max(1, sum(w.size for w in weights)), 4)
        student = make_student(None)
        run = out / f"ssm{j}"
        cfg = replace(config, seed=config.seed + j - 1)
        distill(run, records, student, cfg, None, progress, weights=weights)
        save_draft(student, run / "draft.safetensors")
        boosted_train.append(top1_hits(student, train))
        boosted_held.append(top1_hits(student, held))
        row: dict[str, Any] = {
            "ssm": j,
            "weighted_share": share,
            "single_top1": _rate(boosted_held[-1]),
            "union_top1": _rate(_union(boosted_held)),
        }
        if control:
            student = make_student(None)
            run = out / f"indep{j}"
            distill(run, records, student, replace(config, seed=config.seed + 100 + j), None, progress)
            save_draft(student, run / "draft.safetensors")
            indep_held.append(top1_hits(student, held))
            row["indep_single_top1"] = _rate(indep_held[-1])
            row["indep_union_top1"] = _rate(_union(indep_held))
        rows.append(row)
        (out / BOOST_FILE).write_text(json.dumps({"criterion": criterion, "rows": rows}, indent=1) + "\n")
        if row["union_top1"] - rows[-2]["union_top1"] < min_gain:
            break
    summary = {"criterion": criterion, "m": m, "rows": rows}
    (out / BOOST_FILE).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary
