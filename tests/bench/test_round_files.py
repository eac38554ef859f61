"""bench.tools.round_files: the tracer of one round's project files, and docs/architecture.md §2.3's list
of them, which must be what the tracer finds."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bench.tools.round_files import ROOT, Recorder, trace_round


def documented_files() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("### 2.3 Files of one round", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "docs/architecture.md §2.3 has no file list"
    count = re.search(r"verdict of round 2: (\d+) files", section)
    files = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    assert count and int(count.group(1)) == len(files), "§2.3's count is not its list's length"
    return files


def test_the_recorder_keeps_only_product_files_and_only_while_on() -> None:
    rec = Recorder()

    def f() -> None:
        pass

    sys.setprofile(rec.hook)
    try:
        f()  # off: not recorded
        assert rec.files == set()
        rec.on = True
        f()
        rec.on = False
    finally:
        sys.setprofile(None)
    assert __file__ in rec.files and rec.product_files() == []  # a test file is not the product's
    rec.files = {str(ROOT / "shared/tree.py"), str(ROOT / "bench/x.py"), "/usr/lib/python3/os.py", "<string>"}
    assert rec.product_files() == ["shared/tree.py"]


def test_the_documented_list_is_what_the_tracer_finds() -> None:
    files = trace_round("smollm2-135m", "llama_cpp", "smollm2-135m-q4", 2)
    assert "cloud_verifier/step.py" in files and "edge_client/trees/builder.py" in files
    assert all(Path(ROOT / f).is_file() for f in files)
    assert files == documented_files(), "update docs/architecture.md §2.3 (python -m bench.tools.round_files)"
