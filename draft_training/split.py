"""The fixed train / held-out split of the benchmark prompts (bench/data), by id and per category.

Each prompt's place is decided by a hash of its category and id alone: within a category the
prompts are ordered by sha256("category/id") and the first ceil(n x HELDOUT) are held out. So the
split does not depend on the order of the files or on the other prompts, a prompt added later lands
on one side without moving the rest, and `draft_training split --check` tells whether the committed
file is still the rule's answer.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.prompts import HUMANEVAL, PROMPTS, BenchPrompt, load_humaneval

SPLIT_FILE = Path(__file__).resolve().parent / "data" / "split.json"
HELDOUT = 1 / 3  # share of each category held out
VERSION = 1


def _key(category: str, pid: int | str) -> str:
    return hashlib.sha256(f"{category}/{pid}".encode()).hexdigest()


def all_prompts(spec_bench: Path = PROMPTS, humaneval: Path = HUMANEVAL) -> list[BenchPrompt]:
    """Every prompt of the two built-in sets (Spec-Bench first turns, HumanEval raw)."""
    out = []
    for line in spec_bench.read_text(encoding="utf-8").splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(BenchPrompt(d["question_id"], d["category"], d["turns"][0]))
    return out + load_humaneval(10**9, humaneval)


Ids = list[int | str]


def make_split(prompts: Iterable[BenchPrompt], heldout: float = HELDOUT) -> dict[str, dict[str, Ids]]:
    """{"train": {category: [ids]}, "heldout": {category: [ids]}}, ids in hash order."""
    if not 0 < heldout < 1:
        raise ValueError(f"the held-out share must be in (0, 1), got {heldout}")
    by_cat: dict[str, Ids] = {}
    for p in prompts:
        ids = by_cat.setdefault(p.category, [])
        if p.question_id in ids:
            raise ValueError(f"prompt id {p.question_id!r} appears twice in category {p.category!r}")
        ids.append(p.question_id)
    train: dict[str, Ids] = {}
    held: dict[str, Ids] = {}
    for cat in sorted(by_cat):
        order = sorted((_key(cat, i), i) for i in by_cat[cat])
        ids = [i for _, i in order]
        k = math.ceil(len(ids) * heldout)
        held[cat], train[cat] = ids[:k], ids[k:]
    return {"train": train, "heldout": held}


def document(split: dict[str, dict[str, Ids]]) -> dict[str, Any]:
    return {
        "version": VERSION,
        "rule": "per category, ids ordered by sha256('category/id'); the first ceil(n / 3) are held out",
        "heldout_share": round(HELDOUT, 6),
        "sources": ["bench/data/spec_bench_dev.jsonl (first turns)", "bench/data/humaneval_dev.jsonl"],
        **split,
    }


@dataclass(frozen=True)
class Split:
    train: dict[str, Ids]
    heldout: dict[str, Ids]

    def side(self, which: str) -> dict[str, Ids]:
        if which not in ("train", "heldout"):
            raise ValueError(f"a split side is 'train' or 'heldout', got {which!r}")
        return self.train if which == "train" else self.heldout

    def prompts(self, which: str, prompts: Sequence[BenchPrompt] | None = None) -> list[BenchPrompt]:
        """The prompts of one side, in the sets' order (every category)."""
        side = self.side(which)
        wanted = {(c, i) for c, ids in side.items() for i in ids}
        return [p for p in (prompts or all_prompts()) if (p.category, p.question_id) in wanted]


def load_split(path: Path = SPLIT_FILE) -> Split:
    """The committed split (a clear error when the file is missing or not a split)."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"no split at {path}: run `python -m draft_training split`") from None
    if (
        d.get("version") != VERSION
        or not isinstance(d.get("train"), dict)
        or not isinstance(d.get("heldout"), dict)
    ):
        raise ValueError(f"{path} is not a version-{VERSION} split file (keys version, train, heldout)")
    return Split(d["train"], d["heldout"])


def write_split(path: Path = SPLIT_FILE) -> dict[str, Any]:
    doc = document(make_split(all_prompts()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def check_split(path: Path = SPLIT_FILE) -> str | None:
    """None when the committed file is the rule's split of today's prompt files, else what differs."""
    want = make_split(all_prompts())
    got = load_split(path)
    for side in ("train", "heldout"):
        have = got.side(side)
        if have != want[side]:
            cats = sorted(c for c in set(have) | set(want[side]) if have.get(c) != want[side].get(c))
            return f"{path}: the {side} side differs from the rule's in categories {cats}"
    return None


def first_per_category(prompts: Sequence[BenchPrompt], per_category: int = 0) -> list[BenchPrompt]:
    """The first `per_category` prompts of each category, in order (0: all of them)."""
    if per_category < 0:
        raise ValueError(f"--per-category must be >= 0, got {per_category}")
    taken: dict[str, int] = {}
    out = []
    for p in prompts:
        if per_category and taken.get(p.category, 0) >= per_category:
            continue
        taken[p.category] = taken.get(p.category, 0) + 1
        out.append(p)
    return out


def write_prompts(path: Path, split: Split, which: str = "heldout", per_category: int = 0) -> int:
    """One side of `split` as a JSONL prompt file (shared.prompts.load_prompt_file's forms: a chat
    prompt as Spec-Bench's {question_id, category, turns}, a raw one as HumanEval's {task_id,
    category, prompt}), the first `per_category` of each category (0: all); the number written."""
    lines = []
    for p in first_per_category(split.prompts(which), per_category):
        if p.raw:
            d: dict[str, Any] = {"task_id": p.question_id, "category": p.category, "prompt": p.text}
        else:
            d = {"question_id": p.question_id, "category": p.category, "turns": [p.text]}
        lines.append(json.dumps(d, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)
