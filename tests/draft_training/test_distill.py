"""draft_training.distill on `tiny`: the student's training forward is the serving forward, the
losses are what they say, distillation lowers the loss and raises held-out agreement with the
teacher, LoRA starts at the base model and trains only its adapters, and a run stopped at a
checkpoint and resumed ends bit for bit where an uninterrupted one does."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.harness import BenchPrompt
from draft_training.cli import main
from draft_training.collect import CollectConfig, collect
from draft_training.distill import (
    DistillConfig,
    distill,
    evaluate,
    example_loss,
    load_examples,
    positions_by_step,
    save_draft,
)
from draft_training.student import Student, TrainSpec, distill_loss, simulated_tau
from shared.model import LlamaModel, Target, build_model, load_target, make_tiny_config
from shared.model.inputs import SeqInput
from shared.model.llama import DecoderLayer


def _student_model(seed: int = 1) -> LlamaModel:
    return build_model(make_tiny_config(), seed, "float32", "cpu")


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Teacher records of `tiny` (seed 0) on a few train and held-out prompts."""
    teacher: Target = load_target("tiny", progress=False)
    root = tmp_path_factory.mktemp("records")
    train = [BenchPrompt(i, "qa", f"question {i}: what is {i} plus {i + 1}?") for i in range(6)]
    held = [BenchPrompt(100 + i, "qa", f"question {100 + i}: name a colour") for i in range(3)]
    config = CollectConfig("tiny", tokens=12, temperatures=(0.0, 1.0), top_k=16, seed=0)
    collect(root / "train", train, config, batch=4, target=teacher, progress=False)
    collect(root / "held", held, config, batch=4, target=teacher, progress=False)
    return root / "train", root / "held"


def test_the_training_forward_is_the_serving_forward() -> None:
    model = _student_model()
    student = Student(model, TrainSpec())
    tokens = torch.tensor([5, 17, 300, 42, 7, 7, 1000, 3], dtype=torch.int64)
    kv = model.new_kv_cache(8, 16)
    kv.add(0)
    with torch.inference_mode():
        rows = SeqInput(0, tokens, torch.arange(len(tokens)), None, torch.arange(len(tokens)))
        (serving,) = model.forward_packed([rows], kv)
    training = student(tokens)
    assert training.shape == serving.shape
    assert torch.allclose(training.detach(), serving, atol=2e-4, rtol=0)
    assert torch.allclose(student(tokens, 5).detach(), training[5:].detach(), atol=1e-5)  # head rows only


def test_the_losses() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]])
    q = torch.softmax(logits, -1)
    ids = torch.tensor([[0, 3]])
    p = torch.tensor([[0.6, 0.3]])
    rest = torch.tensor([0.1])
    target = torch.tensor([0])
    q_rest = 1 - q[0, 0] - q[0, 3]
    kl = 0.6 * (0.6 / q[0, 0]).log() + 0.3 * (0.3 / q[0, 3]).log() + 0.1 * (0.1 / q_rest).log()
    ce = -q[0, 0].log()
    assert float(distill_loss(logits, ids, p, rest, target, "kl", 0.1)) == pytest.approx(
        float(kl + 0.1 * ce), abs=1e-6
    )
    tvd = 0.5 * ((0.6 - q[0, 0]).abs() + (0.3 - q[0, 3]).abs() + (0.1 - q_rest).abs())
    assert float(distill_loss(logits, ids, p, rest, target, "tvd", 0.0)) == pytest.approx(
        float(tvd), abs=1e-6
    )
    # the student equal to the teacher's distribution: KL 0
    same = torch.log(torch.tensor([[0.6, 0.05, 0.05, 0.3]]))
    assert float(distill_loss(same, ids, p, rest, target, "kl", 0.0)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="kl"):
        distill_loss(logits, ids, p, rest, target, "js")


def test_simulated_tau_counts_runs_of_matches() -> None:
    # 20 matches: the runs from each position are 20, 19, ..., 1 (cut by the record's end)
    assert simulated_tau([[True] * 20], depth=8) == pytest.approx(1 + sum(range(13, 21)) / 20)
    assert simulated_tau([[False] * 10]) == 1.0
    # runs starting at each position of T T F T: 2, 1, 0, 1 -> P(>=1) = 3/4, P(>=2) = 1/4
    assert simulated_tau([[True, True, False, True]], depth=2) == pytest.approx(2.0)


def _mean_loss(student: Student, records: Path, config: DistillConfig) -> float:
    examples = load_examples(records)
    with torch.no_grad():
        return sum(float(example_loss(student, ex, config)) for ex in examples) / len(examples)


def test_distillation_lowers_the_loss_and_raises_heldout_agreement(
    records: tuple[Path, Path], tmp_path: Path
) -> None:
    train, held = records
    student = Student(_student_model(), TrainSpec())
    before = evaluate(student, load_examples(held))
    config = DistillConfig("tiny", steps=30, batch=4, lr=3e-3, eval_every=30, checkpoint_every=0)
    loss_before = _mean_loss(student, train, config)
    summary = distill(tmp_path, train, student, config, held, progress=False)
    after = summary["evals"][-1]
    assert summary["evals"][0]["top1"] == before["top1"] and after["step"] == 30
    assert after["top1"] > before["top1"] + 0.2 and after["tau"] > before["tau"]
    # the training loss (KL + 0.1 x CE over every train record) falls by more than half
    assert _mean_loss(student, train, config) < 0.5 * loss_before
    # the teacher positions trained on: whole epochs of one record a step count every record once
    examples = load_examples(train)
    lengths = sum(len(ex.target) for ex in examples)
    n = len(examples)
    assert positions_by_step(examples, [n, 3 * n, 0], 1, 7) == {0: 0, n: lengths, 3 * n: 3 * lengths}
    assert 0 < after["train_positions"] <= 30 * 4 * max(len(ex.target) for ex in examples)
    doc = json.loads((tmp_path / "train.json").read_text())
    assert doc["distill"]["steps"] == 30 and len(doc["evals"]) == 2
    save_draft(student, tmp_path / "draft.safetensors")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "draft.safetensors"))
    layer = student.model.layers[0]
    assert isinstance(layer, DecoderLayer) and torch.equal(saved["layers.0.qkv"], layer.qkv)


def test_lora_starts_at_the_base_and_trains_only_its_adapters(
    records: tuple[Path, Path], tmp_path: Path
) -> None:
    train, _ = records
    model = _student_model()
    base = {n: p.clone() for n, p in model.named_parameters()}
    student = Student(model, TrainSpec(blocks=(1,), lora_rank=4, lora_targets=("qkv", "down")))
    names = [n for n, _ in student.trainable()]
    assert names == ["lora.1_qkv_a", "lora.1_qkv_b", "lora.1_down_a", "lora.1_down_b"]
    tokens = torch.tensor([5, 6, 7, 8])
    with torch.no_grad():
        assert torch.equal(student(tokens), Student(_student_model(), TrainSpec(blocks=()))(tokens))
    distill(tmp_path, train, student, DistillConfig("tiny", steps=3, lr=1e-2, eval_every=0), progress=False)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())  # the base is untouched
    with torch.no_grad():
        adapted = student(tokens)
        student.merge_lora()
        assert torch.allclose(student(tokens), adapted, atol=1e-4)
    layer = model.layers[1]
    assert isinstance(layer, DecoderLayer) and not torch.equal(layer.qkv, base["layers.1.qkv"])
    with pytest.raises(ValueError, match="lora-targets"):
        TrainSpec(lora_rank=2, lora_targets=("mlp",)).check(2)
    with pytest.raises(ValueError, match="--blocks"):
        Student(_student_model(), TrainSpec(blocks=(9,)))


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(
    records: tuple[Path, Path], tmp_path: Path
) -> None:
    train, held = records
    config = DistillConfig("tiny", steps=8, batch=3, lr=2e-3, eval_every=4, checkpoint_every=2, seed=5)
    whole = Student(_student_model(), TrainSpec(blocks=(0, 1)))
    distill(tmp_path / "whole", train, whole, config, held, progress=False)
    cut = Student(_student_model(), TrainSpec(blocks=(0, 1)))
    part = distill(tmp_path / "cut", train, cut, config, held, progress=False, stop_after=3)
    assert part["steps"] == 3
    # what an interrupted run leaves: its settings and the evaluations up to its last checkpoint
    assert [e["step"] for e in json.loads((tmp_path / "cut" / "train.json").read_text())["evals"]] == [0]
    resumed = Student(_student_model(), TrainSpec(blocks=(0, 1)))  # a new process: fresh weights
    done = distill(tmp_path / "cut", train, resumed, config, held, progress=False)
    assert done["steps"] == 8
    for (n, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    other = DistillConfig("tiny", steps=8, batch=3, lr=1e-3, eval_every=4, checkpoint_every=2, seed=5)
    with pytest.raises(ValueError, match="other settings"):
        distill(
            tmp_path / "cut",
            train,
            Student(_student_model(), TrainSpec(blocks=(0, 1))),
            other,
            progress=False,
        )


def test_the_cli_distills_and_refuses_bad_values(records: tuple[Path, Path], tmp_path: Path) -> None:
    train, held = records
    out = tmp_path / "run"
    args = ["--records", str(train), "--heldout", str(held), "--out", str(out), "--draft", "tiny"]
    assert main(["distill", *args, "--steps", "2", "--batch", "2", "--eval-every", "1", "--no-progress"]) == 0
    assert (out / "draft.safetensors").exists() and (out / "checkpoint" / "state.json").exists()
    assert main(["distill", "--records", str(tmp_path / "none"), "--out", str(out), "--draft", "tiny"]) == 2
    assert main(["distill", "--records", str(train), "--out", str(out), "--draft", "tiny", "--lr", "0"]) == 2


def test_bf16_autocast_trains_in_float32_weights_and_is_refused_by_name_when_unknown(
    records: tuple[Path, Path], tmp_path: Path
) -> None:
    """--autocast bf16: the forward runs in bf16 (its logits differ from float32's), the weights and
    the optimizer stay float32, the loss falls and held-out agreement rises as in float32; a run
    without it writes no autocast key (runs from before the option resume)."""
    train, held = records
    ex = load_examples(train)[0]
    student = Student(_student_model(), TrainSpec())
    plain = DistillConfig("tiny", steps=30, batch=4, lr=3e-3, eval_every=30, checkpoint_every=0)
    bf16 = DistillConfig(
        "tiny", steps=30, batch=4, lr=3e-3, eval_every=30, checkpoint_every=0, autocast="bf16"
    )
    with torch.no_grad():
        a, b = example_loss(student, ex, plain), example_loss(student, ex, bf16)
    assert a.dtype == b.dtype == torch.float32 and not torch.equal(a, b)
    assert abs(float(a) - float(b)) < 0.05 * float(a)  # the same loss, to bf16's precision
    before = evaluate(student, load_examples(held))
    loss_before = _mean_loss(student, train, plain)
    summary = distill(tmp_path / "bf16", train, student, bf16, held, progress=False)
    assert _mean_loss(student, train, plain) < 0.5 * loss_before
    after = summary["evals"][-1]
    assert after["top1"] > before["top1"] + 0.2 and after["tau"] > before["tau"]
    assert all(p.dtype == torch.float32 for _, p in student.trainable())
    assert json.loads((tmp_path / "bf16" / "train.json").read_text())["distill"]["autocast"] == "bf16"
    distill(
        tmp_path / "plain",
        train,
        Student(_student_model(), TrainSpec()),
        replace(plain, steps=1),
        progress=False,
    )
    assert "autocast" not in json.loads((tmp_path / "plain" / "train.json").read_text())["distill"]
    with pytest.raises(ValueError, match="--autocast"):
        replace(plain, autocast="fp16").check()
    args = ["distill", "--records", str(train), "--out", str(tmp_path / "cli"), "--draft", "tiny"]
    assert main([*args, "--autocast", "fp16"]) == 2  # argparse names the flag and its choices


def test_keep_best_saves_the_step_of_the_best_validation_top1(
    records: tuple[Path, Path], tmp_path: Path
) -> None:
    """--validation sets prompts apart (both temperatures of a prompt together, never trained on);
    --keep best ends with the weights of the best validation step: the same weights as a run of the
    same settings stopped at that step."""
    from draft_training.distill import split_validation

    train, held = records
    examples = load_examples(train)
    kept, val = split_validation(examples, 0.5)
    assert val and kept and len(kept) + len(val) == len(examples)
    prompts = {ex.name.rsplit("__t", 1)[0] for ex in val}
    assert not prompts & {ex.name.rsplit("__t", 1)[0] for ex in kept}
    assert len(val) == 2 * len(prompts)  # greedy and T 1 of each prompt set apart together
    assert [e.name for e in split_validation(examples, 0.5)[1]] == [e.name for e in val]  # by name: fixed
    config = DistillConfig("tiny", steps=12, batch=2, lr=2e-2, eval_every=2, checkpoint_every=0, seed=3,
                           validation=0.5, keep="best")  # fmt: skip
    best = Student(_student_model(), TrainSpec(blocks=(0,)))
    summary = distill(tmp_path / "best", train, best, config, held, progress=False)
    vals = [e["validation_top1"] for e in summary["evals"]]
    step = summary["kept"]["step"]
    assert summary["kept"]["validation_top1"] == max(vals)
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4, 6, 8, 10, 12]
    assert all(e["validation_positions"] == sum(len(x.target) for x in val) for e in summary["evals"])
    doc = json.loads((tmp_path / "best" / "train.json").read_text())
    assert doc["kept"]["step"] == step and doc["distill"]["keep"] == "best"
    plain = Student(_student_model(), TrainSpec(blocks=(0,)))
    if step:
        distill(
            tmp_path / "last",
            train,
            plain,
            replace(config, keep="last"),
            held,
            progress=False,
            stop_after=step,
        )
    for (n, a), (_, b) in zip(best.trainable(), plain.trainable(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="--validation"):
        DistillConfig("tiny", keep="best").check()
    with pytest.raises(ValueError, match="--validation"):
        DistillConfig("tiny", validation=1.0).check()
    with pytest.raises(ValueError, match="leaves"):
        split_validation(examples[:1], 0.5)


def test_runs_without_a_validation_share_keep_their_settings(
    records: tuple[Path, Path], tmp_path: Path
) -> None:
    """The new options are left out of train.json at their defaults, so runs from before them resume."""
    from draft_training.distill import _settings

    train, held = records
    doc = _settings(DistillConfig("tiny"), TrainSpec(), train, held)
    assert not {"validation", "keep", "autocast"} & set(doc["distill"])
    doc = _settings(DistillConfig("tiny", validation=0.2, keep="best"), TrainSpec(), train, held)
    assert doc["distill"]["validation"] == 0.2 and doc["distill"]["keep"] == "best"


def test_a_checkpoint_folder_the_trainer_did_not_write_is_refused_and_kept(
    records: tuple[Path, Path], tmp_path: Path
) -> None:
    train, _ = records
    out = tmp_path / "mine"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "notes.txt").write_text("a user's file\n")
    config = DistillConfig("tiny", steps=2, batch=2, checkpoint_every=1, seed=1)
    with pytest.raises(ValueError, match="not a checkpoint"):
        distill(out, train, Student(_student_model(), TrainSpec(blocks=(0, 1))), config, progress=False)
    assert (out / "checkpoint" / "notes.txt").read_text() == "a user's file\n"
    args = ["distill", "--records", str(train), "--out", str(out), "--draft", "tiny", "--no-progress"]
    assert main([*args, "--steps", "1", "--batch", "2"]) == 2
    assert (out / "checkpoint" / "notes.txt").exists()
