"""bench.robustness.chaos on a small budget: the verifier is killed twice mid-generation and restarted; every
interrupted output equals the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

from bench.robustness import chaos


def test_two_kills(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    assert chaos.main(["--kills", "2", "--tokens", "24", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kills"] == 2 and doc["identical"] and doc["tokens_lost"] == 0 and doc["tokens_repeated"] == 0
    assert doc["resumed_generations"] >= 2 and doc["resume_ms_median"] > 0
    assert {"kills", "generations", "identical", "tokens_lost", "tokens_repeated", "resume_ms_median",
            "resume_ms_p95"} <= set(doc)  # fmt: skip
