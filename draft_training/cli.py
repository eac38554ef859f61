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

from draft_training.cli_options import (
    COMMANDS,
    BoostOptions,
    CollectOptions,
    DistillOptions,
    DraftsOptions,
    ExportOptions,
    SplitOptions,
    options_from_args,
)
from shared.config_cli import add_config_flags


def build_parser() -> argparse.ArgumentParser:
    """One subparser per options dataclass (draft_training.cli_options), its flags generated from
    the fields' `cli` metadata; `drafts`' positional ALIAS arguments are added by hand."""
    ap = argparse.ArgumentParser(
        prog="draft-training",
        description="Train a draft for a target from the target's own outputs (distillation).",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for cls in COMMANDS:
        p = sub.add_parser(cls.COMMAND, help=cls.HELP, description=cls.DESCRIPTION)
        if cls is DraftsOptions:
            p.add_argument("aliases", nargs="*", help=DraftsOptions.ALIASES_HELP)
        add_config_flags(p, cls)
    return ap


def _drafts(o: DraftsOptions) -> int:
    from draft_training.drafts import build_all, default_aliases

    infos = build_all(o.aliases or default_aliases(o.qwen), rebuild=o.rebuild, progress=o.progress)
    for info in infos:
        last = info.get("evals", [])[-1:] or [None]
        print(json.dumps({"alias": info.get("alias"), "path": info["path"], "last_eval": last[0]}))
    return 0


def _export(o: ExportOptions) -> int:
    from draft_training.distill import load_draft_weights
    from draft_training.export import export_gguf
    from edge_client.models import resolve_draft
    from shared.model import load_target
    from shared.model_store.trained import trained_path

    if o.name is not None and (o.out is not None or o.lora):
        raise ValueError("--name writes the named draft in the cache: give it without --out and --lora")
    named = None if o.name is None else trained_path(o.name)  # the name checked before any work
    base = Path(resolve_draft(o.draft, progress=False))
    draft = load_target(str(base), progress=False)
    if o.lora:
        return _export_lora(o, base, draft.model.config)
    load_draft_weights(draft.model, o.run / "draft.safetensors")
    out = named or o.out or o.run / "draft.gguf"
    info = export_gguf(draft.model, base, out, o.gguf_type)
    if named is not None:
        about = {"name": o.name, "run": str(o.run.resolve()), "draft": o.draft, "gguf_type": o.gguf_type}
        named.with_name(named.name + ".json").write_text(json.dumps(about, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({"path": info["path"], "rewritten": len(info["rewritten"]), "copied": info["copied"]}))
    return 0


def _export_lora(o: ExportOptions, base: Path, config: Any) -> int:
    from safetensors.torch import load_file

    from draft_training.distill import CHECKPOINT, SETTINGS
    from draft_training.export import export_lora_gguf

    ck, settings = o.run / CHECKPOINT / "trainable.safetensors", o.run / SETTINGS
    if not ck.is_file() or not settings.is_file():
        raise FileNotFoundError(f"{o.run} holds no distill checkpoint ({ck}): run `draft-training distill`")
    spec = json.loads(settings.read_text(encoding="utf-8"))["train_spec"]
    if int(spec.get("lora_rank", 0)) < 1:
        raise ValueError(f"{o.run} trained without LoRA (--lora-rank 0): export it without --lora")
    prefix = "lora."
    adapters = {k[len(prefix) :]: v for k, v in load_file(str(ck)).items() if k.startswith(prefix)}
    out = o.out or o.run / "lora.gguf"
    info = export_lora_gguf(adapters, float(spec["lora_alpha"]), config, base, out)
    print(json.dumps({"path": info["path"], "adapted": len(info["adapted"])}))
    return 0


def _boost(o: BoostOptions) -> int:
    from draft_training.boost import boost, parse_criterion
    from draft_training.distill import DistillConfig, load_draft_weights
    from draft_training.student import Student, TrainSpec
    from edge_client.models import resolve_draft
    from shared.model import load_target

    parse_criterion(o.criterion)
    config = DistillConfig(
        o.draft, o.steps, o.batch, o.lr, seed=o.seed, eval_every=0, max_positions=o.max_positions,
        autocast=o.autocast,
    )  # fmt: skip
    config.check()
    base = str(resolve_draft(o.draft, progress=o.progress))

    def make_student(weights: Path | None) -> Student:
        model = load_target(base, progress=False).model
        if weights is not None:
            load_draft_weights(model, weights)
        return Student(model, TrainSpec(), seed=o.seed)

    summary = boost(
        o.out, o.records, o.heldout, o.ssm1 / "draft.safetensors", make_student, config, m=o.m,
        criterion=o.criterion, control=o.control, min_gain=o.min_gain, progress=o.progress,
    )  # fmt: skip
    print(json.dumps(summary))
    return 0


def _distill(o: DistillOptions) -> int:
    from draft_training.distill import DistillConfig, distill, save_draft
    from draft_training.student import Student, TrainSpec
    from edge_client.models import resolve_draft
    from shared.model import load_target

    blocks = tuple(int(b) for b in o.blocks.split(",") if b.strip()) if o.blocks else None
    spec = TrainSpec(blocks, o.lora_rank, o.lora_alpha, tuple(t for t in o.lora_targets.split(",") if t))
    config = DistillConfig(
        str(o.draft), o.steps, o.batch, o.lr, 0.0, o.loss, o.ce_weight, o.seed, o.eval_every,
        o.checkpoint_every, o.max_positions, o.autocast, o.validation, o.keep,
    )  # fmt: skip
    config.check()
    path = o.draft if o.draft == "tiny" else str(resolve_draft(o.draft, progress=o.progress))
    draft = load_target(path, progress=o.progress)
    student = Student(draft.model, spec, seed=o.seed)
    summary = distill(o.out, o.records, student, config, o.heldout, progress=o.progress)
    save_draft(student, o.out / "draft.safetensors")
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
    """Run the parsed command with its options."""
    o = options_from_args(a)
    if isinstance(o, SplitOptions):
        return _split(o)
    if isinstance(o, CollectOptions):
        return _collect(o)
    if isinstance(o, DistillOptions):
        return _distill(o)
    if isinstance(o, ExportOptions):
        return _export(o)
    if isinstance(o, BoostOptions):
        return _boost(o)
    return _drafts(o)


def _split(o: SplitOptions) -> int:
    from draft_training import split as splits

    if o.prompts_out is not None:
        written = splits.write_prompts(o.prompts_out, splits.load_split(), o.side, o.per_category)
        print(f"wrote {o.prompts_out}: {written} {o.side} prompts")
        return 0
    if o.check:
        problem = splits.check_split()
        print(problem or f"{splits.SPLIT_FILE}: the committed split is the rule's")
        return 1 if problem else 0
    doc = splits.write_split()
    n = {s: sum(len(v) for v in doc[s].values()) for s in ("train", "heldout")}
    print(f"wrote {splits.SPLIT_FILE}: {n['train']} train, {n['heldout']} held-out prompts")
    return 0


def _collect(o: CollectOptions) -> int:
    from draft_training import split as splits
    from draft_training.collect import CollectConfig, collect, collect_traces

    config = CollectConfig(o.model, o.tokens, o.temperatures, o.top_k, o.seed)
    config.check()
    if o.from_traces is not None:
        print(json.dumps(collect_traces(o.out, o.from_traces, config, progress=o.progress)))
        return 0
    split = splits.load_split(o.split) if o.split else splits.load_split()
    prompts = split.prompts(o.side)
    if o.limit:
        prompts = prompts[: o.limit]
    print(json.dumps(collect(o.out, prompts, config, batch=o.batch, progress=o.progress)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
