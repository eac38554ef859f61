"""draft_training.boost on `tiny`: each criterion weights the positions it should, a weighted loss
ignores the positions of weight 0, and a boosted SSM_2 trains on what SSM_1 misses (its weighted
share is SSM_1's miss rate on the train records) beside an independent control."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.harness import BenchPrompt
from draft_training.boost import boost, parse_criterion, position_weights, top1_hits
from draft_training.collect import CollectConfig, collect
from draft_training.distill import DistillConfig, distill, load_draft_weights, load_examples, save_draft
from draft_training.student import Student, TrainSpec, distill_loss
from shared.model import LlamaModel, build_model, load_target, make_tiny_config


def test_each_criterion_weights_the_positions_it_should() -> None:
    covered = [np.array([1, 1, 0, 1, 1, 1, 1, 0], bool), np.array([1, 1, 1, 1], bool)]
    token = position_weights(covered, "token")
    assert token[0].tolist() == [0, 0, 1, 0, 0, 0, 0, 1] and token[1].tolist() == [0, 0, 0, 0]
    window = position_weights(covered, "window:2")  # windows [0,1] [2,3] [4,5] [6,7]
    assert window[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1] and window[1].tolist() == [0, 0, 0, 0]
    seq = position_weights(covered, "sequence")  # the paper's rule: drop a sample matched whole
    assert seq[0].tolist() == [1] * 8 and seq[1].tolist() == [0] * 4
    for bad in ("window", "window:0", "tokens", "window:x"):
        with pytest.raises(ValueError, match="criterion"):
            parse_criterion(bad)


def test_a_weighted_loss_ignores_the_positions_of_weight_0() -> None:
    logits = torch.randn(3, 10, requires_grad=True)
    ids, probs = torch.tensor([[1, 2]] * 3), torch.tensor([[0.5, 0.3]] * 3)
    rest, target = torch.full((3,), 0.2), torch.tensor([1, 2, 3])
    plain = distill_loss(logits, ids, probs, rest, target)
    ones = distill_loss(logits, ids, probs, rest, target, weights=torch.ones(3))
    assert torch.allclose(plain, ones)
    distill_loss(logits, ids, probs, rest, target, weights=torch.tensor([1.0, 0.0, 1.0])).backward()
    assert logits.grad is not None and torch.all(logits.grad[1] == 0) and logits.grad[0].abs().sum() > 0


def _model(seed: int = 1) -> LlamaModel:
    return build_model(make_tiny_config(), seed, "float32", "cpu")


def test_boosting_trains_ssm2_on_what_ssm1_misses(tmp_path: Path) -> None:
    teacher = load_target("tiny", progress=False)
    train_p = [BenchPrompt(i, "qa", f"question {i}: what is {i} plus {i + 1}?") for i in range(6)]
    held_p = [BenchPrompt(100 + i, "qa", f"question {100 + i}: name a colour") for i in range(3)]
    config = CollectConfig("tiny", tokens=12, temperatures=(0.0, 1.0), top_k=16, seed=0)
    collect(tmp_path / "train", train_p, config, batch=4, target=teacher, progress=False)
    collect(tmp_path / "held", held_p, config, batch=4, target=teacher, progress=False)
    cfg = DistillConfig("tiny", steps=8, batch=4, lr=3e-3, eval_every=0, checkpoint_every=0)
    ssm1 = Student(_model(), TrainSpec())
    distill(tmp_path / "run1", tmp_path / "train", ssm1, cfg, None, progress=False)
    save_draft(ssm1, tmp_path / "run1" / "draft.safetensors")

    def make_student(weights: Path | None) -> Student:
        model = _model()
        if weights is not None:
            load_draft_weights(model, weights)
        return Student(model, TrainSpec())

    summary = boost(
        tmp_path / "boost", tmp_path / "train", tmp_path / "held", tmp_path / "run1" / "draft.safetensors",
        make_student, cfg, m=2, criterion="token", control=True, min_gain=-1.0, progress=False,
    )  # fmt: skip
    rows = summary["rows"]
    assert [r["ssm"] for r in rows] == [1, 2]
    train = load_examples(tmp_path / "train")
    hits = top1_hits(make_student(tmp_path / "run1" / "draft.safetensors"), train)
    miss = 1 - sum(int(h.sum()) for h in hits) / sum(h.size for h in hits)
    assert rows[1]["weighted_share"] == pytest.approx(miss, abs=1e-4) and 0 < miss < 1
    # the union is of the two drafts' held-out hits, as saved (SSM_1's and the boosted SSM_2's)
    held = load_examples(tmp_path / "held")
    h1 = top1_hits(make_student(tmp_path / "run1" / "draft.safetensors"), held)
    h2 = top1_hits(make_student(tmp_path / "boost" / "ssm2" / "draft.safetensors"), held)
    both = [a | b for a, b in zip(h1, h2, strict=True)]
    assert rows[1]["union_top1"] == round(sum(int(u.sum()) for u in both) / sum(u.size for u in both), 4)
    assert rows[0]["union_top1"] == round(sum(int(u.sum()) for u in h1) / sum(u.size for u in h1), 4)
    assert "indep_union_top1" in rows[1]
    doc = json.loads((tmp_path / "boost" / "ssm2" / "train.json").read_text())
    assert "weights_sha256" in doc  # SSM_2 trained on the weighted records, the control not
    assert "weights_sha256" not in json.loads((tmp_path / "boost" / "indep2" / "train.json").read_text())
    # an SSM that adds less than min_gain of union top-1 ends the run before m (no gain reaches 1.0)
    stopped = boost(
        tmp_path / "b3", tmp_path / "train", tmp_path / "held", tmp_path / "run1" / "draft.safetensors",
        make_student, cfg, m=3, criterion="window:4", control=False, min_gain=1.0, progress=False,
    )  # fmt: skip
    assert [r["ssm"] for r in stopped["rows"]] == [1, 2] and not (tmp_path / "b3" / "ssm3").exists()
    with pytest.raises(ValueError, match="at least 2"):
        boost(tmp_path / "b2", tmp_path / "train", tmp_path / "held", tmp_path / "run1" / "draft.safetensors",
              make_student, cfg, m=1)  # fmt: skip
