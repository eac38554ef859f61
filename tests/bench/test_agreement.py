"""bench.exactness.agreement on the target's outputs cached once (`--records`): collect folders are read
instead
of running the target, every position counted, and records of another vocabulary refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.exactness.agreement import main
from bench.harness import BenchPrompt
from draft_training.collect import MANIFEST, CollectConfig, collect
from shared.model import load_target


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("agreement") / "held"
    prompts = [
        BenchPrompt(0, "qa", "question 0: what is 2 plus 3?"),
        BenchPrompt(1, "qa", "question 1: name a colour"),
        BenchPrompt(2, "writing", "write one line about the sea"),
    ]
    config = CollectConfig("tiny", tokens=6, temperatures=(0.0, 1.0))
    collect(out, prompts, config, target=load_target("tiny", progress=False), progress=False)
    return out


def _positions(folder: Path, temperature: str) -> int:
    import numpy as np

    paths = (folder / "records").glob(f"*__t{temperature}.npz")
    return sum(len(np.load(p, allow_pickle=False)["tokens"]) for p in paths)


def test_cached_outputs_are_read_instead_of_running_the_target(records: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    args = ["--records", str(records), "--draft", "tiny", "--backend", "torch", "--no-progress"]
    assert main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    temps = doc["temperatures"]
    assert set(temps) == {"0", "1"}
    # every cached position is counted, per category and overall
    assert temps["0"]["all"]["positions"] == _positions(records, "0") > 0
    assert temps["1"]["all"]["positions"] == _positions(records, "1") > 0
    assert (
        temps["0"]["qa"]["positions"] + temps["0"]["writing"]["positions"] == temps["0"]["all"]["positions"]
    )
    # the draft is the target itself: its top-1 is the greedy token at every position
    assert temps["0"]["all"]["top1"] == 1.0
    assert temps["1"]["all"]["top5"] >= temps["1"]["all"]["top1"]
    # --temperatures still selects
    assert main([*args, "--temperatures", "0", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["temperatures"]) == {"0"}


def test_records_of_another_vocabulary_are_refused(
    records: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    (other / "records").mkdir(parents=True)
    for p in (records / "records").glob("*.npz"):
        (other / "records" / p.name).write_bytes(p.read_bytes())
    manifest = json.loads((records / MANIFEST).read_text()) | {"vocab_fingerprint": "0" * 16}
    (other / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SystemExit):
        main(["--records", str(other), "--draft", "tiny", "--backend", "torch", "--no-progress"])
    assert "is not the draft's" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--records", str(tmp_path / "missing"), "--draft", "tiny", "--backend", "torch"])
    assert "no manifest.json" in capsys.readouterr().err
