"""bench.robustness.fuzz end to end on a small budget: the verifier survives, refuses every over-limit frame,
and an honest session afterwards is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.robustness import fuzz


@pytest.mark.slow  # the protocol fuzz of tests/shared/test_protocol.py runs in the default suite
def test_a_short_fuzz_run(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    rc = fuzz.main(["--frames", "600", "--seconds", "60", "--connections", "2", "--check-every", "20",
                    "--json", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0
    assert doc["frames"] >= 600 and doc["crashes"] == 0 and doc["server_alive"] and doc["ready_after"]
    assert doc["over_limit_sent"] >= 25 and doc["over_limit_accepted"] == 0
    assert doc["honest_identical_to_ar"]
    assert sum(doc["closes"].values()) > 0 and doc["replies"].get("error", 0) > 0  # it did provoke
