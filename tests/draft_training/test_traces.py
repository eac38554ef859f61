"""Training data from real sessions: `edge-client generate --record DIR` logs the tokens the target
committed, `draft-training collect --from-traces DIR` adds the teacher's distribution at every
position (the same arrays as a generated record), and bad session files are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.harness import BenchPrompt
from draft_training.collect import CollectConfig, collect, collect_traces, prompt_ids, read_record
from edge_client.record import read_records, write_record
from edge_client.stats import GenerationResult
from shared.model import Target, load_target
from tests.cloud_verifier.service import LiveServer


@pytest.fixture(scope="module")
def teacher() -> Target:
    return load_target("tiny", progress=False)


def test_recorded_sessions_of_the_cli_become_records_whose_top1_is_the_greedy_token(
    teacher: Target, tmp_path: Path
) -> None:
    """A greedy session's tokens are the target's argmax: teacher-forced, the teacher's top-1 at every
    recorded position is the recorded token."""
    sessions = tmp_path / "sessions"
    with LiveServer() as srv:
        for prompt in ("Say hi",):  # one CLI process (a few seconds of start-up each)
            cmd = [sys.executable, "-m", "edge_client", "generate", "--server", srv.ws, "--draft", "tiny"]
            cmd += ["--drafter", "torch", "--max-tokens", "10", "--json", "--record", str(sessions), prompt]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
            printed = json.loads(out.stdout)
            rec = json.loads(sorted(sessions.glob("*.json"))[-1].read_text())
            assert rec["tokens"] == printed["tokens"] and rec["mode"] == "greedy"
    config = CollectConfig("tiny", tokens=64, temperatures=(0.0,), top_k=8)
    summary = collect_traces(tmp_path / "out", sessions, config, target=teacher, progress=False)
    assert summary["sessions"] == 1 and summary["collected_now"] == 1
    files = sorted((tmp_path / "out" / "records").glob("trace__*.npz"))
    assert len(files) == 1
    for f in files:
        r = read_record(f)
        assert r["tokens"].size > 0 and np.array_equal(r["top_ids"][:, 0], r["tokens"])
        assert np.all(r["top_probs"][:, :-1] >= r["top_probs"][:, 1:])
        assert np.allclose(r["top_probs"].sum(1) + r["rest"], 1.0, atol=1e-4)
    again = collect_traces(tmp_path / "out", sessions, config, target=teacher, progress=False)
    assert again["collected_now"] == 0 and again["skipped"] == 1  # resumable


def test_a_traced_record_equals_the_generated_one(teacher: Target, tmp_path: Path) -> None:
    """The teacher-forced forward over a record's own tokens gives its stored distribution (the same
    teacher rows, computed in one forward instead of one per token)."""
    config = CollectConfig("tiny", tokens=12, temperatures=(0.0, 1.0), top_k=8)
    p = BenchPrompt(7, "qa", "what is seven plus eight?")
    collect(tmp_path / "gen", [p], config, target=teacher, progress=False)
    sessions = tmp_path / "sessions"
    for t in (0.0, 1.0):
        r = read_record(tmp_path / "gen" / "records" / f"qa__7__t{t:g}.npz")
        assert r["prompt"].tolist() == prompt_ids(teacher, p)
        gen = GenerationResult(r["prompt"].tolist(), r["tokens"].tolist())
        write_record(sessions, gen, "tiny", teacher.vocab_fingerprint, "match", t)
    collect_traces(tmp_path / "traced", sessions, config, target=teacher, progress=False)
    traced = sorted((tmp_path / "traced" / "records").glob("*.npz"))
    for t, f in zip((0.0, 1.0), traced, strict=True):
        a, b = read_record(tmp_path / "gen" / "records" / f"qa__7__t{t:g}.npz"), read_record(f)
        assert np.array_equal(a["tokens"], b["tokens"]) and np.array_equal(a["top_ids"], b["top_ids"])
        assert np.allclose(a["top_probs"], b["top_probs"], atol=1e-5)


def test_bad_session_files_are_refused_by_name(teacher: Target, tmp_path: Path) -> None:
    vocab = int(teacher.config.vocab_size)
    good = write_record(tmp_path / "s", GenerationResult([1, 2, 3], [4, 5]), "tiny", "ff" * 16, "greedy", 0.0)
    assert [r.tokens for r in read_records(tmp_path / "s", vocab)] == [[4, 5]]
    config = CollectConfig("tiny", tokens=8, temperatures=(0.0,), top_k=4)
    with pytest.raises(ValueError, match="another vocabulary"):
        collect_traces(tmp_path / "o1", tmp_path / "s", config, target=teacher, progress=False)
    good.unlink()
    for name, text, what in (
        ("a.json", "{not json", "not a JSON"),
        ("b.json", json.dumps({"format": 1, "prompt_ids": [1], "tokens": [vocab]}), "token id"),
        ("c.json", json.dumps({"format": 9, "prompt_ids": [1], "tokens": []}), "format"),
        ("d.json", json.dumps({"format": 1, "prompt_ids": [], "tokens": [1]}), "empty"),
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / name).write_text(text)
        with pytest.raises(ValueError, match=what) as info:
            list(read_records(folder, vocab))
        assert name in str(info.value)
    with pytest.raises(FileNotFoundError, match="generate --record"):
        list(read_records(tmp_path / "missing", vocab))
