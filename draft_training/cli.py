"""`python -m draft_training` (`draft-training`): the steps of training a draft for a target.

draft-training split [--check] [--prompts-out FILE [--side heldout|train] [--per-category N]]
draft-training collect --out DIR [--model M] [--tokens N] [--temperatures 0,1] [--batch B]
                       [--top-k K] [--seed S] [--limit N] [--side train|heldout] [--no-progress]
                       [--from-traces DIR]
draft-training distill --records DIR --out DIR [--heldout DIR] [--draft D] [--steps N]
                       [--validation SHARE --keep best] ...
draft-training export --run DIR [--draft D] [--gguf-type f32|q8_0] [--out FILE]
draft-training boost --records DIR --heldout DIR --ssm1 RUN --out DIR [--m M]
                     [--criterion token|window:N|sequence] [--no-control]
draft-training drafts [ALIAS ...] [--rebuild] [--no-progress]      (what `make drafts` runs)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.cli_args import integer, nonempty, number, positive_int
from shared.model_store import DEFAULT_TARGET

COUNT = integer(0)  # a count where 0 means "all" or "none"
SEED = integer(0, (1 << 31) - 1)
RATE = number(0.0, lo_open=True)  # a learning rate: finite and > 0
WEIGHT = number(0.0)  # a finite weight >= 0
MODEL = nonempty("the model")


def _floats(text: str) -> tuple[float, ...]:
    """Comma-separated temperatures, each finite and >= 0 (CollectConfig.check bounds them above)."""
    one = number(0.0)
    return tuple(one(x) for x in text.split(",") if x.strip())


def _blocks(text: str) -> str:
    """Comma-separated block indices (>= 0); empty: every block."""
    for b in text.split(","):
        if b.strip():
            integer(0)(b)
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="draft-training",
        description="Train a draft for a target from the target's own outputs (distillation).",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sp = sub.add_parser(
        "split",
        help="write the fixed train / held-out split of the benchmark prompts",
        description="Write draft_training/data/split.json: per category, prompts ordered by "
        "sha256('category/id'), the first third held out. --check compares the committed file instead.",
    )
    sp.add_argument("--check", action="store_true", help="exit 1 if the committed split is not the rule's")
    sp.add_argument(
        "--prompts-out",
        type=Path,
        default=None,
        metavar="FILE",
        help="instead: write one side of the committed split as a JSONL prompt file that bench.e2e, "
        "bench.network and bench.outcomes read with --prompt-file (to measure trained drafts)",
    )
    sp.add_argument(
        "--side", choices=("train", "heldout"), default="heldout", help="the side --prompts-out writes"
    )
    sp.add_argument(
        "--per-category",
        type=COUNT,
        default=0,
        help="with --prompts-out: the first N prompts of each category (0: all)",
    )
    cp = sub.add_parser(
        "collect",
        help="the teacher's continuations of the train prompts with its top-k probabilities",
        description="Continue every train prompt with the fp32 target (greedy and sampled), storing each "
        "position's token, the teacher's top-k probabilities and the remaining mass; resumable.",
    )
    cp.add_argument("--out", type=Path, required=True, help="output folder (created; resumed if it exists)")
    cp.add_argument(
        "--model", type=MODEL, default=DEFAULT_TARGET, help="the target (teacher): alias or GGUF path"
    )
    cp.add_argument("--tokens", type=positive_int(), default=128, help="new tokens per record at most")
    cp.add_argument(
        "--temperatures",
        type=_floats,
        default=(0.0, 1.0),
        help="decoding temperatures, one record per prompt each (0: greedy)",
    )
    cp.add_argument("--batch", type=positive_int(), default=4, help="sequences per forward")
    cp.add_argument(
        "--top-k", type=positive_int(), default=32, help="teacher probabilities kept per position"
    )
    cp.add_argument("--seed", type=SEED, default=0, help="seeds the sampled records (each from its name)")
    cp.add_argument("--limit", type=COUNT, default=0, help="only the first N train prompts (0: all)")
    cp.add_argument("--split", type=Path, default=None, help="split file (default: the committed one)")
    cp.add_argument(
        "--side",
        choices=("train", "heldout"),
        default="train",
        help="which prompts: train (to distill on) or heldout (to evaluate on, never trained on)",
    )
    cp.add_argument(
        "--from-traces",
        type=Path,
        default=None,
        metavar="DIR",
        help="instead of generating: the sessions `edge-client generate --record DIR` logged (the target's "
        "own tokens), with the teacher's distribution at every position (one forward per session)",
    )
    cp.add_argument("--no-progress", action="store_true", help="no progress bar")
    dp = sub.add_parser(
        "distill",
        help="train the draft towards the teacher's records (KL + 0.1 CE), full blocks or LoRA",
        description="Distill the draft from collect's records: forward KL on the teacher's stored top-k + "
        "rest (or TVD) plus 0.1 x cross-entropy on its token; deterministic with --seed; checkpoints and "
        "resumes in --out; evaluates held-out top-1 and simulated tau on --heldout records.",
    )
    dp.add_argument("--records", type=Path, required=True, help="a collect folder of train records")
    dp.add_argument("--heldout", type=Path, default=None, help="a collect folder of held-out records")
    dp.add_argument("--out", type=Path, required=True, help="run folder (checkpoints; resumed if it exists)")
    dp.add_argument(
        "--draft", type=MODEL, default="smollm2-135m-q4-l8", help="the draft to train: alias or GGUF path"
    )
    dp.add_argument("--steps", type=positive_int(), default=200, help="optimizer steps")
    dp.add_argument("--batch", type=positive_int(), default=4, help="records per step")
    dp.add_argument("--lr", type=RATE, default=1e-4, help="AdamW learning rate")
    dp.add_argument("--loss", choices=("kl", "tvd"), default="kl", help="divergence from the teacher")
    dp.add_argument("--ce-weight", type=WEIGHT, default=0.1, help="weight of the cross-entropy term")
    dp.add_argument("--blocks", type=_blocks, default="", help="blocks to train, e.g. 4,5,6,7 (default: all)")
    dp.add_argument("--lora-rank", type=COUNT, default=0, help="LoRA rank (0: full fine-tuning of --blocks)")
    dp.add_argument("--lora-alpha", type=RATE, default=16.0, help="LoRA scale numerator (alpha / rank)")
    dp.add_argument("--lora-targets", default="qkv,o,gate_up,down", help="projections LoRA adapts")
    dp.add_argument("--eval-every", type=COUNT, default=50, help="steps between held-out evaluations")
    dp.add_argument("--checkpoint-every", type=COUNT, default=50, help="steps between checkpoints")
    dp.add_argument("--max-positions", type=COUNT, default=0, help="teacher positions per record (0: all)")
    dp.add_argument("--seed", type=SEED, default=0, help="seeds the record order and the LoRA init")
    dp.add_argument(
        "--validation",
        type=number(0.0, 1.0),
        default=0.0,
        help="the share of train prompts set apart (never trained on) and evaluated at --eval-every, to "
        "choose the kept step with --keep best (0: none)",
    )
    dp.add_argument(
        "--keep",
        choices=("last", "best"),
        default="last",
        help="the draft written: the last step's, or the step of the best validation top-1 (needs "
        "--validation; the --heldout records never choose it)",
    )
    _autocast_arg(dp)
    dp.add_argument("--no-progress", action="store_true", help="no progress bar")
    ep = sub.add_parser(
        "export",
        help="write a distill run's draft as a GGUF llama.cpp runs (tensors training left alone copied)",
        description="Write the trained draft (RUN/draft.safetensors) as a GGUF: the draft's own GGUF with "
        "every tensor training changed rewritten (F32, or Q8_0) and the rest copied byte for byte.",
    )
    ep.add_argument("--run", type=Path, required=True, help="a distill run folder (holds draft.safetensors)")
    ep.add_argument(
        "--draft", type=MODEL, default="smollm2-135m-q4-l8", help="the draft the run trained: alias or GGUF"
    )
    ep.add_argument("--gguf-type", choices=("f32", "q8_0"), default="f32", help="type of rewritten tensors")
    ep.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output GGUF (default: RUN/draft.gguf, with --lora RUN/lora.gguf)",
    )
    ep.add_argument(
        "--name",
        type=nonempty("the name"),
        default=None,
        help="also give the draft a name: written to <cache>/models/trained/NAME.gguf (with NAME.gguf.json: "
        "the run and base it came from), so `--draft NAME` runs it in every drafter backend (instead of "
        "--out; a-z 0-9 . _ -, not an alias)",
    )
    ep.add_argument(
        "--lora",
        action="store_true",
        help="write the LoRA run's adapters alone as a llama.cpp adapter GGUF (from RUN/checkpoint), applied "
        "at run time on the unchanged --draft by `edge-client generate --draft-lora FILE`",
    )
    op = sub.add_parser(
        "boost",
        help="SSM_2..m trained on what the SSMs before them miss (SpecInfer's boost-tuning, adapted)",
        description="Train SSM_2..m from the base draft, each on the train records weighted by what SSM_1.."
        "SSM_j-1 already cover (draft_training.boost), and, as the control, as many SSMs trained "
        "independently; writes OUT/boost.json with single and union held-out top-1.",
    )
    op.add_argument("--records", type=Path, required=True, help="a collect folder of train records")
    op.add_argument("--heldout", type=Path, required=True, help="a collect folder of held-out records")
    op.add_argument(
        "--ssm1", type=Path, required=True, help="SSM_1: a distill run folder (its draft.safetensors)"
    )
    op.add_argument(
        "--out", type=Path, required=True, help="output folder (each SSM's run; resumed if it exists)"
    )
    op.add_argument(
        "--draft", type=MODEL, default="smollm2-135m-q4-l8", help="the base draft every SSM starts from"
    )
    op.add_argument("--m", type=integer(2), default=3, help="SSMs at most, SSM_1 included")
    op.add_argument(
        "--criterion", default="token", help="token (default), window:N, or sequence (the paper's rule)"
    )
    op.add_argument("--no-control", action="store_true", help="skip the independently trained SSMs")
    op.add_argument(
        "--min-gain", type=WEIGHT, default=0.01, help="stop when union top-1 grows less than this"
    )
    op.add_argument("--steps", type=positive_int(), default=200, help="optimizer steps per SSM")
    op.add_argument("--batch", type=positive_int(), default=4, help="records per step")
    _autocast_arg(op)
    op.add_argument("--lr", type=RATE, default=3e-4, help="AdamW learning rate")
    op.add_argument("--max-positions", type=COUNT, default=0, help="teacher positions per record (0: all)")
    op.add_argument(
        "--seed", type=SEED, default=0, help="SSM_j trains with seed + j - 1 (control: + 100 + j)"
    )
    op.add_argument("--no-progress", action="store_true", help="no progress bar")
    bp = sub.add_parser(
        "drafts",
        help="build the default trained drafts into the model cache (what `make drafts` runs)",
        description="Collect, distill and export each recipe's draft (draft_training.drafts) into the "
        "model cache under its alias (e.g. smollm2-135m-l8-kd, about an hour on 2 cores). Every step "
        "resumes an interrupted build; a built alias is kept unless --rebuild.",
    )
    bp.add_argument("aliases", nargs="*", help="which recipes (default: all of them)")
    bp.add_argument("--rebuild", action="store_true", help="train again even if the alias is built")
    bp.add_argument(
        "--qwen",
        action="store_true",
        help="also the Qwen pilot qwen2.5-coder-0.5b-kd (LoRA of the 0.5B taught by the 1.5B); "
        "make drafts QWEN=1",
    )
    bp.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def _drafts(a: argparse.Namespace) -> int:
    from draft_training.drafts import build_all, default_aliases

    infos = build_all(a.aliases or default_aliases(a.qwen), rebuild=a.rebuild, progress=not a.no_progress)
    for info in infos:
        last = info.get("evals", [])[-1:] or [None]
        print(json.dumps({"alias": info.get("alias"), "path": info["path"], "last_eval": last[0]}))
    return 0


def _export(a: argparse.Namespace) -> int:
    from draft_training.distill import load_draft_weights
    from draft_training.export import export_gguf
    from edge_client.models import resolve_draft
    from shared.model import load_target
    from shared.model_store.trained import trained_path

    if a.name is not None and (a.out is not None or a.lora):
        raise ValueError("--name writes the named draft in the cache: give it without --out and --lora")
    named = None if a.name is None else trained_path(a.name)  # the name checked before any work
    base = Path(resolve_draft(a.draft, progress=False))
    draft = load_target(str(base), progress=False)
    if a.lora:
        return _export_lora(a, base, draft.model.config)
    load_draft_weights(draft.model, a.run / "draft.safetensors")
    out = named or a.out or a.run / "draft.gguf"
    info = export_gguf(draft.model, base, out, a.gguf_type)
    if named is not None:
        about = {"name": a.name, "run": str(a.run.resolve()), "draft": a.draft, "gguf_type": a.gguf_type}
        named.with_name(named.name + ".json").write_text(json.dumps(about, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({"path": info["path"], "rewritten": len(info["rewritten"]), "copied": info["copied"]}))
    return 0


def _export_lora(a: argparse.Namespace, base: Path, config: Any) -> int:
    from safetensors.torch import load_file

    from draft_training.distill import CHECKPOINT, SETTINGS
    from draft_training.export import export_lora_gguf

    ck, settings = a.run / CHECKPOINT / "trainable.safetensors", a.run / SETTINGS
    if not ck.is_file() or not settings.is_file():
        raise FileNotFoundError(f"{a.run} holds no distill checkpoint ({ck}): run `draft-training distill`")
    spec = json.loads(settings.read_text(encoding="utf-8"))["train_spec"]
    if int(spec.get("lora_rank", 0)) < 1:
        raise ValueError(f"{a.run} trained without LoRA (--lora-rank 0): export it without --lora")
    prefix = "lora."
    adapters = {k[len(prefix) :]: v for k, v in load_file(str(ck)).items() if k.startswith(prefix)}
    out = a.out or a.run / "lora.gguf"
    info = export_lora_gguf(adapters, float(spec["lora_alpha"]), config, base, out)
    print(json.dumps({"path": info["path"], "adapted": len(info["adapted"])}))
    return 0


def _autocast_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--autocast",
        choices=("none", "bf16"),
        default="none",
        help="bf16: the training forward and backward under CPU bf16 autocast (faster where the CPU has "
        "AMX or AVX-512 BF16, docs/training.md); the loss, weights and optimizer stay float32",
    )


def _boost(a: argparse.Namespace) -> int:
    from draft_training.boost import boost, parse_criterion
    from draft_training.distill import DistillConfig, load_draft_weights
    from draft_training.student import Student, TrainSpec
    from edge_client.models import resolve_draft
    from shared.model import load_target

    parse_criterion(a.criterion)
    config = DistillConfig(
        a.draft, a.steps, a.batch, a.lr, seed=a.seed, eval_every=0, max_positions=a.max_positions,
        autocast=a.autocast,
    )  # fmt: skip
    config.check()
    base = str(resolve_draft(a.draft, progress=not a.no_progress))

    def make_student(weights: Path | None) -> Student:
        model = load_target(base, progress=False).model
        if weights is not None:
            load_draft_weights(model, weights)
        return Student(model, TrainSpec(), seed=a.seed)

    summary = boost(
        a.out, a.records, a.heldout, a.ssm1 / "draft.safetensors", make_student, config, m=a.m,
        criterion=a.criterion, control=not a.no_control, min_gain=a.min_gain, progress=not a.no_progress,
    )  # fmt: skip
    print(json.dumps(summary))
    return 0


def _distill(a: argparse.Namespace) -> int:
    from draft_training.distill import DistillConfig, distill, save_draft
    from draft_training.student import Student, TrainSpec
    from edge_client.models import resolve_draft
    from shared.model import load_target

    blocks = tuple(int(b) for b in a.blocks.split(",") if b.strip()) if a.blocks else None
    spec = TrainSpec(blocks, a.lora_rank, a.lora_alpha, tuple(t for t in a.lora_targets.split(",") if t))
    config = DistillConfig(
        str(a.draft), a.steps, a.batch, a.lr, 0.0, a.loss, a.ce_weight, a.seed, a.eval_every,
        a.checkpoint_every, a.max_positions, a.autocast, a.validation, a.keep,
    )  # fmt: skip
    config.check()
    path = a.draft if a.draft == "tiny" else str(resolve_draft(a.draft, progress=not a.no_progress))
    draft = load_target(path, progress=not a.no_progress)
    student = Student(draft.model, spec, seed=a.seed)
    summary = distill(a.out, a.records, student, config, a.heldout, progress=not a.no_progress)
    save_draft(student, a.out / "draft.safetensors")
    last = summary["evals"][-1] if summary["evals"] else None
    kept = {"kept": summary["kept"]} if "kept" in summary else {}
    print(json.dumps({"steps": summary["steps"], "loss": summary["loss"], "last_eval": last, **kept}))
    return 0


# the output each command writes: (flag, its namespace name, a folder (True) or a file)
OUTPUTS = {
    "split": ("--prompts-out", "prompts_out", False),
    "collect": ("--out", "out", True),
    "distill": ("--out", "out", True),
    "boost": ("--out", "out", True),
    "export": ("--out", "out", False),
}


def output_error(a: argparse.Namespace) -> str | None:
    """Why the output the command's flag names cannot be written (the flag, the path, why), or
    None; a folder is made here, as the command would make it. Checked before any work."""
    flag, name, folder = OUTPUTS.get(a.command, ("", "", False))
    path: Path | None = getattr(a, name, None)
    if path is None:
        return None
    if not folder and path.is_dir():
        return f"{flag} {path}: is a folder, not a file"
    where = path if folder else path.parent
    for above in (where, *where.parents):
        if above.exists():
            if not above.is_dir():
                return f"{flag} {path}: cannot be written ({above} is a file, not a folder)"
            break
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{flag} {path}: cannot be written ({exc.strerror or exc})"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"{flag} {path}: cannot be written (no write permission in {where})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status: 0 done, 2 a usage error (a flag's value, an input a flag
    names that is missing or not what it should be, an output that cannot be written), 1 another
    known error while working (a file that cannot be read or written), 130 interrupted. Each error
    is one line on stderr."""
    try:
        try:
            a = build_parser().parse_args(argv)
        except SystemExit as exc:  # argparse printed the usage and what was wrong (or the help)
            return exc.code if isinstance(exc.code, int) else 2
        wrong = output_error(a)
        if wrong is not None:
            print(f"draft-training {a.command}: {wrong}", file=sys.stderr)
            return 2
        try:
            return _run(a)
        except (ValueError, FileNotFoundError) as exc:
            print(f"draft-training {a.command}: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"draft-training {a.command}: {exc}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("draft-training: interrupted", file=sys.stderr)
        return 130


def _run(a: argparse.Namespace) -> int:
    from draft_training import split as splits

    if a.command == "split":
        if a.prompts_out is not None:
            written = splits.write_prompts(a.prompts_out, splits.load_split(), a.side, a.per_category)
            print(f"wrote {a.prompts_out}: {written} {a.side} prompts")
            return 0
        if a.check:
            problem = splits.check_split()
            print(problem or f"{splits.SPLIT_FILE}: the committed split is the rule's")
            return 1 if problem else 0
        doc = splits.write_split()
        n = {s: sum(len(v) for v in doc[s].values()) for s in ("train", "heldout")}
        print(f"wrote {splits.SPLIT_FILE}: {n['train']} train, {n['heldout']} held-out prompts")
        return 0
    if a.command in ("distill", "export", "drafts", "boost"):
        run = {"distill": _distill, "export": _export, "drafts": _drafts, "boost": _boost}[a.command]
        return run(a)
    from draft_training.collect import CollectConfig, collect, collect_traces

    config = CollectConfig(a.model, a.tokens, a.temperatures, a.top_k, a.seed)
    config.check()
    if a.from_traces is not None:
        print(json.dumps(collect_traces(a.out, a.from_traces, config, progress=not a.no_progress)))
        return 0
    split = splits.load_split(a.split) if a.split else splits.load_split()
    prompts = split.prompts(a.side)
    if a.limit:
        prompts = prompts[: a.limit]
    print(json.dumps(collect(a.out, prompts, config, batch=a.batch, progress=not a.no_progress)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
