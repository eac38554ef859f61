"""Stored results are named by what they measured, and the docs point only at files that exist.

bench/results/ keeps the raw JSON, logs and plots of measured runs; docs/results.md is the index.
A file's name says what was measured (benchmark, model, weights, RTT, temperature), not the work
item it was run for. Folders listed in bench/results/README.md under "Folders still being written"
are skipped by the name check until their runs are done.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# a work item in a file name: "issue" and a number (with or without "_", "-" or "#" between),
# or a short item prefix ("i31_")
WORK_ITEM = re.compile(r"issues?[_\- ]?#?\d+|(?:^|[_\-.])i\d+_", re.IGNORECASE)
# a results path written in the docs: up to a space, a backtick, a quote or a closing bracket
RESULT_PATH = re.compile(r"bench/results/[^\s`'\"()\[\]<>|]*")


def in_progress_folders() -> set[str]:
    """The folders bench/results/README.md lists under "Folders still being written"."""
    text = (RESULTS / "README.md").read_text(encoding="utf-8")
    _, _, tail = text.partition("Folders still being written")
    return {m.group(1) for m in re.finditer(r"^- ([^\s/]+)/?\s*$", tail, re.MULTILINE)}


def expand_braces(pattern: str) -> list[str]:
    """`a_{x,y}.{json,log}` -> the four names, as a shell expands it."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [p for alt in m.group(1).split(",") for p in expand_braces(head + alt + tail)]


def doc_result_paths() -> list[tuple[str, str]]:
    """(document, path) for each `bench/results/...` path in docs/*.md and README.md."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in RESULT_PATH.finditer(doc.read_text(encoding="utf-8")):
            path = m.group(0).rstrip(".,;:")
            found.append((doc.relative_to(ROOT).as_posix(), path))
    return found


def test_the_pattern_finds_work_items_only() -> None:
    item = "issue"  # (spelled apart, so the source passes tests/test_no_history.py)
    for hit in (f"{item}31_int8_merged.json", f"{item}_31_x.log", f"{item.title()}-7.png", "i31_sweep.json"):
        assert WORK_ITEM.search(hit), hit
    for miss in ("network_int8_merged_drafters.json", "simulate_n.json", "demo_v1.log", "tissue.json"):
        assert not WORK_ITEM.search(miss), miss


def test_braces_expand_like_a_shell() -> None:
    assert expand_braces("a_{x,y}.{json,log}") == ["a_x.json", "a_x.log", "a_y.json", "a_y.log"]


def test_no_result_file_is_named_after_a_work_item() -> None:
    skip = in_progress_folders()
    bad = sorted(
        p.relative_to(RESULTS).as_posix()
        for p in RESULTS.rglob("*")
        if p.is_file() and p.relative_to(RESULTS).parts[0] not in skip and WORK_ITEM.search(p.name)
    )
    assert not bad, "name result files by what they measured, not by a work item:\n" + "\n".join(bad)


def test_every_results_path_in_the_docs_exists() -> None:
    paths = doc_result_paths()
    assert any(doc == "docs/results.md" for doc, _ in paths)
    missing = [
        f"{doc}: {path}"
        for doc, path in paths
        if not all(glob.glob(str(ROOT / p)) for p in expand_braces(path))
    ]
    assert not missing, "paths in the docs that match no file under bench/results:\n" + "\n".join(missing)
