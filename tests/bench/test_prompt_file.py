"""The benchmarks' prompts: the built-in sets ship in the repository (bench/data) and a user's own
JSONL file (`--prompt-file`, Spec-Bench's or HumanEval's form) replaces them."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import DATA, add_prompt_file_arg, load_prompt_file, load_suite, suite_from_args
from bench.lib.runner import UsageError
from tests.test_repository_paths import tracked_files

REPO = Path(__file__).resolve().parents[2]


def test_the_built_in_sets_are_in_the_repository() -> None:
    assert DATA.is_relative_to(REPO)
    suite = load_suite(3, 13)
    assert [p.raw for p in suite] == [True] * 3 + [False] * 13
    assert len({p.category for p in suite[3:]}) == 13  # round-robin: every Spec-Bench category once


def test_benchmark_prompts_load_in_a_copy_with_nothing_beside_it(tmp_path: Path) -> None:
    """A user's clone: the tracked files alone, in a folder with nothing beside them."""
    clone = tmp_path / "alone" / "repo"
    for rel in tracked_files(REPO):
        if rel.startswith(("bench/", "shared/")) and (REPO / rel).is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, clone / rel)
    code = "from bench.harness import load_suite; s = load_suite(4, 4); print(len(s), s[0].question_id)"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=clone, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(clone), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["8", "HumanEval/0"]


def test_a_prompt_file_of_either_form(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    lines = [
        {"question_id": 7, "category": "travel", "turns": ["Plan a day in Lyon.", "And a second day?"]},
        {"task_id": "Mine/1", "prompt": "def add(a, b):\n"},
        {"task_id": "Mine/2", "prompt": "def sub(a, b):\n", "category": "code"},
    ]
    f.write_text("\n".join(json.dumps(d) for d in lines) + "\n\n")
    got = load_prompt_file(f)
    assert [(p.question_id, p.category, p.text, p.raw) for p in got] == [
        (7, "travel", "Plan a day in Lyon.", False),
        ("Mine/1", "mine", "def add(a, b):\n", True),
        ("Mine/2", "code", "def sub(a, b):\n", True),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"question_id": 1, "turns": []}\n', "mine.jsonl:1: expected Spec-Bench's"),
        ('{"task_id": "a", "prompt": "x"}\n{"task_id": "b"}\n', "mine.jsonl:2: expected"),
        ("[1, 2]\n", "mine.jsonl:1: a line must be a JSON object"),
        ('{"prompt": \n', "mine.jsonl:1: not JSON"),
        ("\n\n", "no prompts in it"),
    ],
)
def test_a_bad_prompt_file_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text(text)
    with pytest.raises(ValueError, match=message.replace("'", ".")):
        load_prompt_file(f)


def test_prompt_files_replace_the_built_in_sets_and_errors_end_the_run(tmp_path: Path) -> None:
    ap = argparse.ArgumentParser(prog="bench")
    add_prompt_file_arg(ap)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"task_id": "A", "prompt": "x = "}\n')
    b.write_text('{"question_id": 2, "category": "c", "turns": ["Hi"]}\n')
    args = ap.parse_args(["--prompt-file", str(a), "--prompt-file", str(b)])
    assert [p.question_id for p in suite_from_args(5, 5, args.prompt_file)] == ["A", 2]
    assert len(suite_from_args(1, 2, None)) == 3
    with pytest.raises(UsageError, match=r"missing\.jsonl: cannot read it"):
        suite_from_args(1, 1, [tmp_path / "missing.jsonl"])


@pytest.mark.parametrize("module", ["bench.end_to_end.network", "bench.end_to_end.e2e"])
def test_the_benchmarks_take_prompt_files(module: str) -> None:
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--prompt-file PATH" in r.stdout
