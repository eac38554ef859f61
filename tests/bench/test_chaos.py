"""bench.robustness.chaos on a small budget: the verifier is killed twice mid-generation and restarted; every
interrupted output equals the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.robustness import chaos


def test_two_kills(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    assert chaos.main(["--kills", "2", "--tokens", "24", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kills"] == 2 and doc["identical"] and doc["tokens_lost"] == 0 and doc["tokens_repeated"] == 0
    assert doc["resumed_generations"] >= 2 and doc["resume_ms_median"] > 0
    assert {"kills", "generations", "identical", "tokens_lost", "tokens_repeated", "resume_ms_median",
            "resume_ms_p95"} <= set(doc)  # fmt: skip


@pytest.mark.slow
def test_two_replica_kills_under_load(tmp_path: Path) -> None:
    """--fleet: two replicas of a fleet are killed while three edges generate; each edge on the
    killed replica resumes on the other, every output equals its uninterrupted run, and the fleet
    runs two replicas again before each next kill."""
    pytest.importorskip("ray")
    out = tmp_path / "chaos_fleet.json"
    assert chaos.main(["--fleet", "--kills", "2", "--tokens", "48", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["replica_kills"] == 2 and doc["identical"] and doc["tokens_lost"] == 0
    # (an edge on the killed replica may have ended before the kill: at least one resumed)
    assert doc["tokens_repeated"] == 0 and doc["resumed_generations"] >= 1
    # the replicas offer their own addresses: every session moved there, resumes included
    assert doc["direct"] and doc["sessions_moved"] == doc["sessions"] > 0
    assert doc["replaced_s_median"] > 0 and doc["replicas"] == 2 and doc["clients"] == 3
