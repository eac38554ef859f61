"""The code speaks of the code: no source file points at a work item (the word "issue" and a number)
or carries a date (a year and month, as a dated results folder is named).

A comment or docstring says what the code does and why, in terms a reader of this checkout can
follow; a tracker's numbering and the day something was measured are not. A measured figure may
stay when it says what was measured (machine, model, prompts); a result file is named by what it
holds (docs/results.md), not by the folder of the day it was written.

Checked: *.py, *.ts, *.js, *.mjs, *.cpp, *.h, *.cu, *.sh and Makefiles, everywhere but the stored
results (bench/results/), installed packages (.venv, node_modules) and tool caches.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".ts", ".js", ".mjs", ".cpp", ".h", ".cu", ".sh"}
NAMES = {"Makefile"}
SKIP_DIRS = {
    ".git",
    ".venv",
    "node_modules",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    ".cache",
    "build",
    "dist",
}
SKIP_PATHS = {"bench/results", "bench/out"}
# "issue", "issues" or "issue #" and a number, any case; a year of the 2020s and a month
HISTORY = re.compile(r"\bissues? ?#?\d+|\b202\d-[01]\d\b", re.IGNORECASE)


def source_files(root: Path = ROOT) -> list[Path]:
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        rel = here.relative_to(root).as_posix()
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.endswith(".egg-info")
            and (f"{rel}/{d}" if rel != "." else d) not in SKIP_PATHS
        )
        found.extend(here / f for f in sorted(files) if Path(f).suffix in SUFFIXES or f in NAMES)
    return found


def history_lines(path: Path) -> list[str]:
    """`path:line: text` for each line of `path` that names a work item or a date."""
    text = path.read_text(encoding="utf-8", errors="replace")
    rel = path.relative_to(ROOT).as_posix()
    lines = enumerate(text.splitlines(), 1)
    return [f"{rel}:{n}: {line.strip()}" for n, line in lines if HISTORY.search(line)]


def test_the_pattern_finds_work_items_and_dates_only() -> None:
    issue, year = "issue", "2026"  # (spelled apart, so this file passes its own check)
    for hit in (f"see {issue} 31", f"({issue.title()} 20, item 4)", f"{issue}s 5 and 6", f"{issue} #12",
                f"rotated {year}-11", f"bench/results/{year}-12-04/x.json"):  # fmt: skip
        assert HISTORY.search(hit), hit
    for miss in ("an issue with the cache", "tissue 3", "2026 tokens", "ids 2026-3000", "x = 12026-11"):
        assert not HISTORY.search(miss), miss


def test_the_walk_sees_the_sources_and_skips_stored_results() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in source_files()}
    assert "tests/test_no_history.py" in files and "shared/model/offload.py" in files
    assert not any(f.startswith(("bench/results/", ".venv/")) or "/node_modules/" in f for f in files)


def test_no_source_file_names_a_work_item_or_a_date() -> None:
    found = [hit for path in source_files() for hit in history_lines(path)]
    assert not found, (
        "say what the code does, not which work item or day it came from (a measured figure may stay, "
        "saying what was measured; point at docs/results.md rather than a dated result file):\n"
        + "\n".join(found)
    )
