"""`distill`: train the draft towards the teacher's stored distributions (`collect`'s records).

Each step reads `batch` records (prompt + teacher tokens), runs the student over the whole sequence
once and takes the loss at the positions that predict the teacher's tokens: forward KL on the stored
top-k + rest (or total variation) plus 0.1 x cross-entropy on the token (`student.distill_loss`),
AdamW with gradient clipping. The record order of every epoch is drawn from the seed, so a run is
deterministic, and one resumed from a checkpoint continues exactly as if it had not stopped.

Evaluation (every `eval_every` steps and at the end) on the held-out records: top-1 agreement (the
student's argmax is the teacher's greedy token, teacher-forced) and the simulated tau of a chain of
8 (`student.simulated_tau`), shown on the progress bar beside the loss.

Choosing the step: `validation` > 0 sets that share of the train prompts apart (by a hash of each
prompt's record name, both temperatures of a prompt on the same side), never trained on, and
evaluates them at the same steps. With `keep="best"` the draft saved is the one of the step with
the best validation top-1 (step 0, the untrained draft, included), not the last step's. The
held-out records stay what the figures are reported on: they never choose the step.

Output folder:

    train.json                 the settings (a resumed run must match them) and the evaluations
    checkpoint/                the latest state: trainable.safetensors, optimizer.safetensors, state.json
    best/                      keep="best": trainable.safetensors of the best validation step so far
    draft.safetensors          the trained draft's weights (every parameter, LoRA merged)

Checkpoints are safetensors and JSON only (nothing is unpickled).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from draft_training.collect import MANIFEST, RECORD_NAME, RECORDS, read_record
from draft_training.student import Student, TrainSpec, distill_loss, simulated_tau

CHECKPOINT = "checkpoint"
BEST = "best"
KEEP = ("last", "best")
SETTINGS = "train.json"
# --autocast: the dtype of the student's training forward under CPU autocast (None: float32 throughout)
AUTOCAST: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DistillConfig:
    draft: str
    steps: int = 200
    batch: int = 4
    lr: float = 1e-4
    weight_decay: float = 0.0
    loss: str = "kl"
    ce_weight: float = 0.1
    seed: int = 0
    eval_every: int = 50
    checkpoint_every: int = 50
    max_positions: int = 0  # 0: every stored position of a record
    autocast: str = "none"  # "bf16": the training forward and backward under CPU bf16 autocast
    validation: float = 0.0  # the share of train prompts set apart to choose the kept step
    keep: str = "last"  # "best": the step of the best validation top-1

    def check(self) -> None:
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"--steps and --batch must be >= 1, got {self.steps} and {self.batch}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.loss not in ("kl", "tvd"):
            raise ValueError(f"--loss must be kl or tvd, got {self.loss!r}")
        if self.eval_every < 0 or self.checkpoint_every < 0 or self.max_positions < 0:
            raise ValueError("--eval-every, --checkpoint-every and --max-positions must be >= 0")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"--autocast must be one of {', '.join(AUTOCAST)}, got {self.autocast!r}")
        if not 0 <= self.validation < 1:
            raise ValueError(f"--validation must be in [0, 1), got {self.validation}")
        if self.keep not in KEEP:
            raise ValueError(f"--keep must be one of {', '.join(KEEP)}, got {self.keep!r}")
        if self.keep == "best" and not (self.validation > 0 and self.eval_every > 0):
            raise ValueError(
                "--keep best chooses by the validation records: give --validation > 0 and --eval-every > 0"
            )


@dataclass
class Example:
    tokens: torch.Tensor  # prompt + teacher tokens[:-1], int64
    start: int  # the position whose logits predict the first teacher token
    target: torch.Tensor  # [n] int64
    top_ids: torch.Tensor  # [n, k] int64
    top_probs: torch.Tensor  # [n, k] float32
    rest: torch.Tensor  # [n] float32
    weight: torch.Tensor | None = None  # [n] float32 per-position weights (boosting); None: all 1
    name: str = ""  # the record's file name, without .npz


def load_examples(folder: Path, max_positions: int = 0, vocab: int | None = None) -> list[Example]:
    """Every record of a `collect` folder, in name order."""
    recs = sorted(p for p in (folder / RECORDS).glob("*.npz") if not p.name.startswith("."))
    if not recs:
        raise FileNotFoundError(f"no records in {folder / RECORDS}: run `draft-training collect` first")
    out = []
    for path in recs:
        r = read_record(path)
        n = len(r["tokens"]) if not max_positions else min(max_positions, len(r["tokens"]))
        if n == 0:
            continue
        seq = np.concatenate([r["prompt"], r["tokens"][: n - 1]]).astype(np.int64)
        if vocab is not None and (seq.max() >= vocab or r["top_ids"][:n].max() >= vocab):
            raise ValueError(f"{path}: token ids beyond the draft's vocabulary ({vocab}): another tokenizer?")
        out.append(
            Example(
                torch.from_numpy(seq),
                len(r["prompt"]) - 1,
                torch.from_numpy(r["tokens"][:n].astype(np.int64)),
                torch.from_numpy(r["top_ids"][:n].astype(np.int64)),
                torch.from_numpy(r["top_probs"][:n].astype(np.float32)),
                torch.from_numpy(r["rest"][:n].astype(np.float32)),
                name=path.stem,
            )
        )
    return out


def example_loss(student: Student, ex: Example, config: DistillConfig) -> torch.Tensor:
    """The example's loss; with `config.autocast` "bf16" the student's forward runs under CPU bf16
    autocast (matrix products in bf16, on AMX or AVX-512 BF16 where the CPU has them) and the loss
    in float32 from its logits."""
    dtype = AUTOCAST[config.autocast]
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = student(ex.tokens, ex.start)[: len(ex.target)]
    logits = logits.float()
    return distill_loss(
        logits, ex.top_ids, ex.top_probs, ex.rest, ex.target, config.loss, config.ce_weight, ex.weight
    )


@torch.no_grad()
def evaluate(student: Student, examples: Sequence[Example], depth: int = 8) -> dict[str, float]:
    """Held-out top-1 agreement with the teacher's token and the simulated tau of a chain of `depth`."""
    agree: list[list[bool]] = []
    for ex in examples:
        logits = student(ex.tokens, ex.start)[: len(ex.target)]
        agree.append((logits.argmax(-1) == ex.target).tolist())
    flat = [a for s in agree for a in s]
    return {
        "top1": round(sum(flat) / max(1, len(flat)), 4),
        "tau": round(simulated_tau(agree, depth), 4),
        "positions": len(flat),
    }


def split_validation(train: list[Example], share: float) -> tuple[list[Example], list[Example]]:
    """(train, validation): the records of about `share` of the prompts, chosen by a hash of the
    record's name without its temperature (a prompt's greedy and sampled records stay together)."""
    if share <= 0:
        return train, []
    keep: list[Example] = []
    val: list[Example] = []
    for ex in train:
        m = RECORD_NAME.match(ex.name)
        prompt = f"{m['category']}__{m['id']}" if m else ex.name
        h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64
        (val if h < share else keep).append(ex)
    if not keep or not val:
        raise ValueError(
            f"--validation {share} leaves {len(keep)} train and {len(val)} validation records of "
            f"{len(train)}: collect more records or change the share"
        )
    return keep, val


def _order(n: int, seed: int, epoch: int) -> list[int]:
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n)]


def _batch(train: Sequence[Example], step: int, batch: int, seed: int) -> list[Example]:
    """The records of step `step`: the seed's order of the records, an epoch at a time."""
    epoch, at = divmod(step * batch, len(train))
    order = _order(len(train), seed, epoch)
    return [train[order[(at + i) % len(train)]] for i in range(batch)]


def positions_by_step(
    train: Sequence[Example], steps: Sequence[int], batch: int, seed: int
) -> dict[int, int]:
    """Teacher positions trained on before each of `steps` (the records' lengths, batch by batch):
    the learning curve's x, exact where records end early at EOS."""
    out: dict[int, int] = {}
    total, done = 0, 0
    for target in sorted(set(steps)):
        for step in range(done, target):
            total += sum(len(ex.target) for ex in _batch(train, step, batch, seed))
        done = max(done, target)
        out[target] = total
    return out


def _settings(config: DistillConfig, spec: TrainSpec, records: Path, heldout: Path | None) -> dict[str, Any]:
    manifest = json.loads((records / MANIFEST).read_text(encoding="utf-8"))
    settings = asdict(config)
    for key, default in (("autocast", "none"), ("validation", 0.0), ("keep", "last")):
        if settings[key] == default:  # runs from before the option resume with their settings
            del settings[key]
    doc = {
        "distill": settings,
        "train_spec": {**asdict(spec), "blocks": list(spec.blocks) if spec.blocks is not None else None},
        "records": str(records),
        "records_manifest": manifest,
        "heldout": str(heldout) if heldout else None,
    }
    return dict(json.loads(json.dumps(doc)))  # as it reads back from train.json (tuples as lists)


def _check_checkpoint(out: Path) -> None:
    """A checkpoint is replaced at every save: refuse a `checkpoint` that this trainer did not write
    (a user's own folder of that name inside --out), so that nothing the user made is removed."""
    ck = out / CHECKPOINT
    if (ck.exists() or ck.is_symlink()) and (ck.is_symlink() or not (ck / "state.json").is_file()):
        raise ValueError(
            f"{ck} is not a checkpoint of `draft-training distill` (no state.json): "
            "give --out a folder of its own or an earlier run's"
        )


def _save(out: Path, student: Student, opt: torch.optim.Optimizer, step: int, evals: list[Any]) -> None:
    from safetensors.torch import save_file

    _check_checkpoint(out)

    tmp = out / f".{CHECKPOINT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _save_trainable(student, tmp, step)
    params = dict(student.trainable())
    state: dict[str, torch.Tensor] = {}
    steps: dict[str, int] = {}
    by_id = {id(p): n for n, p in params.items()}
    for p, s in opt.state.items():
        name = by_id[id(p)]
        state[f"{name}::exp_avg"] = s["exp_avg"].contiguous()
        state[f"{name}::exp_avg_sq"] = s["exp_avg_sq"].contiguous()
        steps[name] = int(s["step"])
    save_file(state, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({"step": step, "adam_steps": steps, "evals": evals}) + "\n")
    final = out / CHECKPOINT
    old = out / f".{CHECKPOINT}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _restore(out: Path, student: Student, opt: torch.optim.Optimizer) -> tuple[int, list[Any]]:
    from safetensors.torch import load_file

    ck = out / CHECKPOINT
    if not (ck / "state.json").exists():
        return 0, []
    state = json.loads((ck / "state.json").read_text())
    _load_trainable(student, ck / "trainable.safetensors")
    params = dict(student.trainable())
    moments = load_file(str(ck / "optimizer.safetensors"))
    for n, p in params.items():
        if n in state["adam_steps"]:
            opt.state[p] = {
                "step": torch.tensor(float(state["adam_steps"][n])),
                "exp_avg": moments[f"{n}::exp_avg"].clone(),
                "exp_avg_sq": moments[f"{n}::exp_avg_sq"].clone(),
            }
    return int(state["step"]), list(state["evals"])


def distill(
    out: Path,
    records: Path,
    student: Student,
    config: DistillConfig,
    heldout: Path | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    weights: Sequence[np.ndarray] | None = None,
) -> dict[str, Any]:
    """Train `student` in place; `stop_after` ends the run early (a checkpoint is written), as an
    interruption would; `weights`: per-position loss weights of every train record, in
    `load_examples` order (boosting; a record whose weights are all 0 is left out). The summary:
    steps done, the evaluations, the final loss and, with keep="best", the step kept (the student
    then holds that step's weights)."""
    config.check()
    torch.manual_seed(config.seed)
    vocab = student.model.config.vocab_size
    train = load_examples(records, config.max_positions, vocab)
    held = load_examples(heldout, config.max_positions, vocab) if heldout else []
    _check_checkpoint(out)
    out.mkdir(parents=True, exist_ok=True)
    want = _settings(config, student.spec, records, heldout)
    if weights is not None:
        train = _weighted(train, weights)
        digest = hashlib.sha256(b"".join(np.asarray(w, np.float32).tobytes() for w in weights))
        want["weights_sha256"] = digest.hexdigest()
    train, val = split_validation(train, config.validation)
    path = out / SETTINGS
    _check_settings(path, want, out)
    params = [p for _, p in student.trainable()]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    step, evals = _restore(out, student, opt)
    bar = tqdm(total=config.steps, initial=step, desc="distill", file=sys.stderr, disable=not progress)
    last_eval = evals[-1] if evals else None
    if (held or val) and step == 0:
        last_eval = _eval_step(out, student, train, held, val, 0, config, evals)
    loss_avg: float | None = None
    t0 = time.perf_counter()
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    while step < end:
        total = _train_step(student, opt, params, train, step, config)
        step += 1
        loss_avg = total if loss_avg is None else 0.9 * loss_avg + 0.1 * total
        if (held or val) and config.eval_every and (step % config.eval_every == 0 or step == config.steps):
            last_eval = _eval_step(out, student, train, held, val, step, config, evals)
        if step == end or (config.checkpoint_every and step % config.checkpoint_every == 0):
            _save(out, student, opt, step, evals)
            path.write_text(json.dumps({**want, "evals": evals}, indent=1) + "\n", encoding="utf-8")
        bar.update(1)
        bar.set_postfix_str(_postfix(loss_avg, last_eval))
    bar.close()
    summary = {"steps": step, "evals": evals, "loss": loss_avg, "seconds": round(time.perf_counter() - t0, 1)}
    doc = {**want, "evals": evals}
    if config.keep == "best" and step == config.steps:
        kept = _best(evals)
        _load_trainable(student, out / BEST / "trainable.safetensors")
        doc["kept"] = summary["kept"] = kept
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return summary


def _check_settings(path: Path, want: dict[str, Any], out: Path) -> None:
    """A run folder's settings must be this run's (resume); a new folder gets them first, so an
    interrupted run is resumed only with the same ones."""
    if path.exists():
        have = json.loads(path.read_text(encoding="utf-8"))
        have.pop("evals", None)
        have.pop("kept", None)
        diff = sorted(k for k in want if have.get(k) != want[k])
        if diff:
            raise ValueError(
                f"{out} holds a run with other settings ({', '.join(diff)} differ): use another --out"
            )
    else:
        path.write_text(json.dumps({**want, "evals": []}, indent=1) + "\n", encoding="utf-8")


def _train_step(
    student: Student, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], train: list[Example],
    step: int, config: DistillConfig,
) -> float:  # fmt: skip
    """One optimizer step on the batch the seed's order gives step `step`; its loss."""
    batch = _batch(train, step, config.batch, config.seed)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for ex in batch:
        loss = example_loss(student, ex, config) / len(batch)
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return total


def _eval_step(
    out: Path, student: Student, train: list[Example], held: list[Example], val: list[Example], step: int,
    config: DistillConfig, evals: list[Any],
) -> dict[str, Any]:  # fmt: skip
    """Evaluate at `step` (held-out; validation as validation_*; the teacher positions trained on so
    far as train_positions), append to `evals`; with keep="best" a new best validation top-1 writes
    the trainable weights to out/best."""
    entry: dict[str, Any] = {"step": step, **(evaluate(student, held) if held else {})}
    entry["train_positions"] = positions_by_step(train, [step], config.batch, config.seed)[step]
    if val:
        entry.update({f"validation_{k}": v for k, v in evaluate(student, val).items()})
    better = config.keep == "best" and all(entry["validation_top1"] > e["validation_top1"] for e in evals)
    evals.append(entry)
    if better:
        _save_trainable(student, out / BEST, step)
    return entry


def _best(evals: list[Any]) -> dict[str, Any]:
    """The evaluation of the best validation top-1 (the earliest of equals)."""
    best = max(evals, key=lambda e: (e["validation_top1"], -e["step"]))
    return {k: best[k] for k in ("step", "validation_top1", "top1", "tau") if k in best}


def _postfix(loss_avg: float | None, e: dict[str, Any] | None) -> str:
    post = f"loss {loss_avg:.3f}"
    if e and "top1" in e:
        post += f" | held-out top-1 {e['top1']:.3f} tau {e['tau']:.2f}"
    if e and "validation_top1" in e:
        post += f" | validation top-1 {e['validation_top1']:.3f}"
    return post


def _save_trainable(student: Student, folder: Path, step: int) -> None:
    """The trainable parameters as folder/trainable.safetensors (its step in the metadata), written whole."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".trainable.safetensors.tmp"
    tensors = {n: p.detach().contiguous() for n, p in student.trainable()}
    save_file(tensors, str(tmp), metadata={"step": str(step)})
    os.replace(tmp, folder / "trainable.safetensors")


def _load_trainable(student: Student, path: Path) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(path))
    params = dict(student.trainable())
    if set(saved) != set(params):
        raise ValueError(f"{path} holds other parameters than this run trains: use another --out folder")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])


def _weighted(train: list[Example], weights: Sequence[np.ndarray]) -> list[Example]:
    """The train examples with their weights; those weighted 0 everywhere left out."""
    if len(weights) != len(train):
        raise ValueError(f"{len(weights)} weight arrays for {len(train)} train records")
    out = []
    for ex, w in zip(train, weights, strict=True):
        w = np.asarray(w, dtype=np.float32)[: len(ex.target)]
        if w.shape != (len(ex.target),) or not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError("weights must be finite, >= 0 and one per stored position of each record")
        if w.any():
            out.append(dataclasses.replace(ex, weight=torch.from_numpy(w.copy())))
    if not out:
        raise ValueError("every train position has weight 0: nothing left to train on")
    return out


def save_draft(student: Student, path: Path) -> None:
    """Every parameter of the trained draft (adapters merged) as safetensors."""
    from safetensors.torch import save_file

    student.merge_lora()
    m = student.model
    tensors = {n: p.detach().contiguous() for n, p in m.named_parameters()}
    save_file(tensors, str(path), metadata={"config": json.dumps(asdict(m.config), default=str)})


def load_draft_weights(model: torch.nn.Module, path: Path) -> None:
    """Load `save_draft`'s file into `model` (the same draft); ValueError when it holds another's."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `draft-training distill` first")
    saved = load_file(str(path))
    params = dict(model.named_parameters())
    if set(saved) != set(params) or any(saved[n].shape != p.shape for n, p in params.items()):
        raise ValueError(f"{path} does not hold the parameters of this draft: trained from another draft?")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
