"""The prompt sets the benchmarks and the draft training run: Spec-Bench's dev prompts (round-robin
over its categories), HumanEval's (raw code prompts), and a user's own JSONL prompt file in
either form. `BenchPrompt` is one prompt; bench.harness re-exports all of this."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The prompt files ship in bench/data (with their source and licence: bench/data/README.md). The
# directory above this package holds both `shared` and `bench`, in a checkout as in an install.
DATA = Path(__file__).resolve().parents[1] / "bench" / "data"
PROMPTS = DATA / "spec_bench_dev.jsonl"
HUMANEVAL = DATA / "humaneval_dev.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int | str
    category: str
    text: str
    raw: bool = False  # given to the model as is (HumanEval code prompts), not as a chat turn


def load_humaneval(n: int, path: Path = HUMANEVAL) -> list[BenchPrompt]:
    """The first n HumanEval dev prompts (function signature + docstring), raw: the model
    completes the body (category "humaneval")."""
    if not path.exists():
        raise FileNotFoundError(
            f"HumanEval prompts not found at {path}: pass a JSONL file of {{task_id, prompt}} lines"
        )
    out: list[BenchPrompt] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and len(out) < n:
            d = json.loads(line)
            out.append(BenchPrompt(d["task_id"], d.get("category", "humaneval"), d["prompt"], raw=True))
    return out


def load_suite(humaneval: int, spec_bench: int) -> list[BenchPrompt]:
    """HumanEval prompts first, then Spec-Bench ones (round-robin over its categories)."""
    return load_humaneval(humaneval) + load_prompts(spec_bench)


def load_prompt_file(path: Path) -> list[BenchPrompt]:
    """A user's prompts: JSONL whose lines are either Spec-Bench's form `{"question_id",
    "category", "turns"}` (the first turn, as one chat turn) or HumanEval's `{"task_id",
    "prompt"}` (raw: the model continues it). Raises ValueError naming the file and line of a
    line that is neither."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--prompt-file {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text") from None
    out: list[BenchPrompt] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompt-file {path}:{no}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{where}: a line must be a JSON object")
        turns, prompt = d.get("turns"), d.get("prompt")
        if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0]:
            qid = d.get("question_id", f"{path.stem}:{no}")
            out.append(BenchPrompt(qid, str(d.get("category", path.stem)), turns[0]))
        elif isinstance(prompt, str) and prompt:
            tid = d.get("task_id", f"{path.stem}:{no}")
            out.append(BenchPrompt(tid, str(d.get("category", path.stem)), prompt, raw=True))
        else:
            raise ValueError(
                f"{where}: expected Spec-Bench's {{question_id, category, turns: [text, ...]}} "
                "or HumanEval's {task_id, prompt: text} (a non-empty first turn or prompt)"
            )
    if not out:
        raise ValueError(f"--prompt-file {path}: no prompts in it")
    return out


def load_prompts(n: int, path: Path = PROMPTS) -> list[BenchPrompt]:
    """n Spec-Bench prompts (first turns), taken round-robin over the categories so every category
    is represented; deterministic."""
    if not path.exists():
        raise FileNotFoundError(
            f"Spec-Bench prompts not found at {path}: "
            "pass a JSONL file of {question_id, category, turns} lines"
        )
    by_cat: dict[str, list[BenchPrompt]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            by_cat.setdefault(d["category"], []).append(
                BenchPrompt(d["question_id"], d["category"], d["turns"][0])
            )
    out: list[BenchPrompt] = []
    cats = sorted(by_cat)
    i = 0
    while len(out) < n and any(by_cat.values()):
        lst = by_cat[cats[i % len(cats)]]
        if lst:
            out.append(lst.pop(0))
        i += 1
    return out
