"""A user's clone has nothing beside it: `python -m bench.end_to_end.network --prompts 2 --tokens 16` runs
from a
copy of the repository's tracked files in an empty folder (nothing beside it, no results, no caches but
the model store's), on the SmolLM2 pair with two modes so it stays short."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tracked_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def test_bench_network_runs_from_a_clone_with_nothing_beside_it(tmp_path: Path) -> None:
    clone = tracked_copy(tmp_path / "outer" / "clone")
    assert not (clone.parent / "shared").exists() and (clone / "shared" / "tree.py").is_file()
    out = tmp_path / "network.json"
    env = {**os.environ, "PYTHONPATH": str(clone)}
    cmd = [
        sys.executable, "-m", "bench.end_to_end.network", "--prompts", "2", "--tokens", "16", "--humaneval",
        "0",
        "--rtt-ms", "0", "--modes", "ar,tree", "--model", "smollm2-135m", "--draft", "smollm2-135m-q4",
        "--drafter", "llama_cpp", "--no-progress", "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["complete"] is True
    modes = {row["mode"] for row in result["rows"]}
    assert modes == {"ar", "tree"}, result["rows"]
    # the code that ran was the clone's, not this checkout's
    code = (
        "import bench.end_to_end.network, shared; print(bench.end_to_end.network.__file__, shared.__file__)"
    )
    probe = subprocess.run(
        [sys.executable, "-c", code], cwd=clone, env=env, capture_output=True, text=True, check=True
    )
    assert all(Path(p).is_relative_to(clone) for p in probe.stdout.split()), probe.stdout
