"""draft_training: the committed train / held-out split and the teacher's records (`collect`) on
`tiny`: the records hold the target's own tokens and distribution, batching changes nothing, an
interrupted run resumes with the missing records only, and other settings are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.harness import BenchPrompt
from draft_training import split as splits
from draft_training.cli import main
from draft_training.collect import CollectConfig, Job, collect, prompt_ids, read_record
from shared.model import Target, decode_step, greedy_generate, load_target, prefill


@pytest.fixture(scope="module")
def tiny() -> Target:
    return load_target("tiny", progress=False)


def test_the_committed_split_is_the_rules_and_the_sides_are_disjoint_and_whole() -> None:
    assert splits.check_split() is None
    s = splits.load_split()
    every = splits.all_prompts()
    train, held = s.prompts("train", every), s.prompts("heldout", every)
    assert not {(p.category, p.question_id) for p in train} & {(p.category, p.question_id) for p in held}
    assert len(train) + len(held) == len(every)
    for cat in {p.category for p in every}:
        n = sum(p.category == cat for p in every)
        assert len(s.heldout[cat]) == -(-n // 3) and len(s.train[cat]) == n - len(s.heldout[cat])


def test_a_prompts_side_is_its_hashs_and_not_the_files_order() -> None:
    every = splits.all_prompts()
    full = splits.make_split(every)
    rng = np.random.default_rng(0)
    shuffled = [every[i] for i in rng.permutation(len(every))]
    assert splits.make_split(shuffled) == full
    for cat in full["train"]:
        held = [splits._key(cat, i) for i in full["heldout"][cat]]
        train = [splits._key(cat, i) for i in full["train"][cat]]
        assert max(held) < min(train)  # held out: the category's lowest hashes
    with pytest.raises(ValueError, match="appears twice"):
        splits.make_split([every[0], every[0]])


def test_a_side_written_as_a_prompt_file_reads_back_as_the_same_prompts(tmp_path: Path) -> None:
    from bench.harness import load_prompt_file

    s = splits.load_split()
    path = tmp_path / "held.jsonl"
    assert main(["split", "--prompts-out", str(path)]) == 0
    back = load_prompt_file(path)
    assert back == s.prompts("heldout") and any(p.raw for p in back) and any(not p.raw for p in back)
    n = splits.write_prompts(path, s, "train", per_category=2)
    cats = {p.category for p in s.prompts("train")}
    back = load_prompt_file(path)
    assert n == len(back) == 2 * len(cats) and back == [p for p in s.prompts("train") if p in back]
    with pytest.raises(ValueError, match="--per-category"):
        splits.write_prompts(path, s, per_category=-1)


def _prompts() -> list[BenchPrompt]:
    return [
        BenchPrompt("t/1", "humaneval", "def add(a, b):\n", raw=True),
        BenchPrompt(7, "writing", "Write one line about the sea."),
        BenchPrompt(9, "qa", "What is the capital of France?"),
    ]


def test_records_hold_the_teachers_tokens_and_distribution(tiny: Target, tmp_path: Path) -> None:
    config = CollectConfig("tiny", tokens=6, temperatures=(0.0, 1.0), top_k=8, seed=3)
    summary = collect(tmp_path, _prompts(), config, batch=2, target=tiny, progress=False)
    assert summary["collected_now"] == 6 and summary["skipped_existing"] == 0
    for p in _prompts():
        ids = prompt_ids(tiny, p)
        greedy = read_record(tmp_path / "records" / f"{Job(p, 0.0).name}.npz")
        assert greedy["prompt"].tolist() == ids
        kv = tiny.new_kv_cache(64, 16)
        assert greedy["tokens"].tolist() == greedy_generate(tiny.model, kv, ids, 6, eos_ids=tiny.eos_ids)
        # the stored distribution is the target's softmax at each position, its top-8 and the rest
        kv = tiny.new_kv_cache(64, 16)
        kv.add(0)
        with torch.inference_mode():
            logits = prefill(tiny.model, kv, 0, ids)
            for i, tok in enumerate(greedy["tokens"].tolist()):
                probs = torch.softmax(logits.float(), -1)
                top = torch.topk(probs, 8)
                assert greedy["top_ids"][i].tolist() == top.indices.tolist()
                assert np.allclose(greedy["top_probs"][i], top.values.numpy(), rtol=0, atol=1e-7)
                assert greedy["rest"][i] == pytest.approx(1 - float(top.values.sum()), abs=1e-6)
                (row,) = tiny.model.forward_packed([decode_step(0, tok, kv.cached_len(0))], kv)
                kv.commit_rows(0, [0])
                logits = row[0]
        sampled = read_record(tmp_path / "records" / f"{Job(p, 1.0).name}.npz")
        assert sampled["top_ids"].shape == (len(sampled["tokens"]), 8)
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert doc["top_k"] == 8 and doc["temperatures"] == [0.0, 1.0] and doc["vocab_fingerprint"]


def test_batching_and_resuming_give_the_same_records(tiny: Target, tmp_path: Path) -> None:
    config = CollectConfig("tiny", tokens=5, temperatures=(0.0, 1.0), top_k=4, seed=1)
    one, many = tmp_path / "one", tmp_path / "many"
    collect(one, _prompts(), config, batch=1, target=tiny, progress=False)
    # "interrupted": only the first prompt done, then the rest in batches of 3
    collect(many, _prompts()[:1], config, batch=3, target=tiny, progress=False)
    (many / "records" / ".junk.tmp.npz").write_bytes(b"half a record")  # a write cut short
    again = collect(many, _prompts(), config, batch=3, target=tiny, progress=False)
    assert again["skipped_existing"] == 2 and again["collected_now"] == 4
    names = sorted(p.name for p in (one / "records").glob("*.npz") if not p.name.startswith("."))
    assert len(names) == 6
    for name in names:
        a, b = read_record(one / "records" / name), read_record(many / "records" / name)
        for k in a:
            assert np.array_equal(a[k], b[k]), (name, k)


def test_other_settings_and_bad_values_are_refused_with_the_reason(tiny: Target, tmp_path: Path) -> None:
    collect(tmp_path, _prompts()[:1], CollectConfig("tiny", tokens=2, top_k=4), target=tiny, progress=False)
    with pytest.raises(ValueError, match="top_k"):
        collect(
            tmp_path, _prompts()[:1], CollectConfig("tiny", tokens=2, top_k=5), target=tiny, progress=False
        )
    with pytest.raises(ValueError, match="--tokens"):
        CollectConfig("tiny", tokens=0).check()
    with pytest.raises(ValueError, match="--temperatures"):
        CollectConfig("tiny", temperatures=(-1.0,)).check()
    assert main(["collect", "--out", str(tmp_path / "x"), "--model", "tiny", "--batch", "0"]) == 2


def test_the_cli_collects_train_prompts_only(tmp_path: Path) -> None:
    assert main(["collect", "--out", str(tmp_path), "--model", "tiny", "--tokens", "2", "--limit", "2",
                 "--temperatures", "0", "--no-progress"]) == 0  # fmt: skip
    held = splits.load_split().heldout
    names = sorted(p.stem for p in (tmp_path / "records").glob("*.npz"))
    assert len(names) == 2
    for n in names:
        cat, pid, _ = n.split("__")
        assert pid not in {str(i).replace("/", "_") for i in held.get(cat, [])}
    assert main(["split", "--check"]) == 0


def test_a_folder_of_other_settings_is_set_aside_and_one_of_the_same_kept(tmp_path: Path) -> None:
    from draft_training.collect import MANIFEST, set_aside_if_stale

    out = tmp_path / "heldout"
    assert set_aside_if_stale(out, {"tokens": 64}) is None  # nothing there yet
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"tokens": 64}))
    assert set_aside_if_stale(out, {"tokens": 64}) is None and out.is_dir()
    aside = set_aside_if_stale(out, {"tokens": 48})
    assert aside is not None and aside.name.startswith("heldout.stale-") and not out.exists()
    assert json.loads((aside / MANIFEST).read_text()) == {"tokens": 64}
