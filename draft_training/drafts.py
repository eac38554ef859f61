"""`make drafts` (`draft-training drafts`): build the default trained drafts into the model cache.

A recipe is the whole pipeline for one model-store alias of kind "trained":

1. `collect` the teacher's continuations of the train prompts (greedy and T 1) and of the held-out
   prompts (greedy and T 1 in two folders, for evaluation only: `heldout`, `heldout_t1`);
2. `distill` the draft towards them (held-out top-1 and simulated tau on the progress bar);
3. `export` the trained draft as a GGUF (tensors training left alone copied byte for byte), written
   under a temporary name and renamed to the alias's file in the model cache, with
   `<file>.json` beside it: the recipe, the evaluations and the wall time of every step.

Every step works in `<cache>/draft_training/<alias>/` and resumes: an interrupted build continues
where it stopped (collect keeps its records, distill its last checkpoint). A built alias is left as
it is unless `--rebuild`. Nothing trained is committed or published: a fresh machine builds its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from draft_training.collect import CollectConfig, collect, manifest, set_aside_if_stale
from draft_training.distill import DistillConfig, distill, save_draft
from draft_training.split import Split, load_split
from draft_training.student import Student, TrainSpec


@dataclass(frozen=True)
class Recipe:
    """How one trained draft is made: teacher, draft, data and training sizes."""

    alias: str  # the model store's alias of kind "trained" it builds
    teacher: str  # the target, exactly as the verifier runs it (fp32)
    draft: str  # the draft trained (alias or GGUF path); its GGUF is the export's base
    tokens: int = 64  # teacher tokens per record
    temperatures: tuple[float, ...] = (0.0, 1.0)
    train_prompts: int = 0  # the first N train prompts (0: all of them)
    heldout_prompts: int = 0  # the first N held-out prompts (0: all of them)
    heldout_tokens: int = 0  # teacher tokens per held-out record (0: `tokens`)
    collect_batch: int = 8
    steps: int = 500
    batch: int = 4
    lr: float = 3e-4
    eval_every: int = 100
    gguf_type: str = "f32"
    lora_rank: int = 0  # > 0: LoRA adapters (the merged file, and the adapters alone as <file>.lora.gguf)
    lora_alpha: float = 16.0
    autocast: str = "none"  # distill's --autocast
    pilot: bool = False  # built only when named (or with --qwen), not by a plain `make drafts`


# the SmolLM2 showcase: the untrained 8-block draft (tau 1.04) distilled from the full 30-block model;
# about an hour on 2 cores (collect ~17 + 6 min, distill ~35 min: the pilot's rates)
RECIPES: dict[str, Recipe] = {
    "smollm2-135m-l8-kd": Recipe("smollm2-135m-l8-kd", "smollm2-135m", "smollm2-135m-q4-l8"),
    # the Qwen pilot (`make drafts QWEN=1`): LoRA of the 0.5B on a slice of the train prompts, the 1.5B
    # teaching; a pilot's size (what it gave: docs/training.md, "The Qwen pilot"), not a full training run
    "qwen2.5-coder-0.5b-kd": Recipe(
        "qwen2.5-coder-0.5b-kd",
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-0.5b-q4",
        tokens=48,
        train_prompts=160,
        heldout_prompts=0,  # all 114
        # at 48 tokens the answers that end early leave 9.1k positions (4,374 greedy + 4,686 at T 1);
        # bench.speculators' Table 1 wants >= 10k
        heldout_tokens=64,
        steps=200,
        batch=4,
        lr=2e-4,
        eval_every=50,
        gguf_type="q8_0",
        lora_rank=16,
        lora_alpha=32.0,
        autocast="none",  # bf16 autocast: 0.97x here (bench.train_step: every weight is cast each step)
        pilot=True,
    ),
}


def work_dir(alias: str) -> Path:
    from shared.model_store.paths import cache_dir

    return cache_dir() / "draft_training" / alias


def _prompts(split: Split, side: str, limit: int) -> list[Any]:
    """The side's prompts; with a `limit`, that many taken round-robin over the categories (each
    category's in the sets' order), so that a slice covers every category."""
    prompts = split.prompts(side)
    if not limit or limit >= len(prompts):
        return prompts
    by_cat: dict[str, list[Any]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out: list[Any] = []
    queues = list(by_cat.values())
    while len(out) < limit:
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    return out


def build(
    recipe: Recipe,
    *,
    out: Path | None = None,
    work: Path | None = None,
    split: Split | None = None,
    rebuild: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the recipe (resuming what an earlier run left) and write its GGUF to `out` (default:
    the alias's file in the model cache); the summary, also written to `<out>.json`."""
    from draft_training.export import export_gguf, export_lora_gguf
    from edge_client.models import resolve_draft
    from shared.model import load_target
    from shared.model_store import cached_path, model_file

    dst = out or cached_path(model_file(recipe.alias))
    info_path = dst.with_name(dst.name + ".json")
    if dst.exists() and not rebuild:
        _say(f"{recipe.alias}: already built ({dst}); --rebuild to train it again", progress)
        known = json.loads(info_path.read_text(encoding="utf-8")) if info_path.exists() else {}
        return {"path": str(dst), **known}
    work = work or work_dir(recipe.alias)
    split = split or load_split()
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    _say(f"{recipe.alias}: 1/3 the teacher's records ({recipe.teacher}) in {work}", progress)
    _collect(recipe, work, split, progress)
    times["collect_s"] = round(time.perf_counter() - t0, 1)
    t1 = time.perf_counter()
    _say(f"{recipe.alias}: 2/3 distilling {recipe.draft} ({recipe.steps} steps)", progress)
    base = resolve_draft(recipe.draft, progress=progress)
    draft = load_target(str(base), progress=progress)
    spec = (
        TrainSpec(lora_rank=recipe.lora_rank, lora_alpha=recipe.lora_alpha)
        if recipe.lora_rank
        else TrainSpec()
    )
    student = Student(draft.model, spec, seed=0)
    config = DistillConfig(
        recipe.draft, recipe.steps, recipe.batch, recipe.lr, eval_every=recipe.eval_every,
        checkpoint_every=recipe.eval_every, autocast=recipe.autocast,
    )  # fmt: skip
    run = distill(work / "run", work / "train", student, config, work / "heldout", progress=progress)
    adapters = {n: p.detach().clone() for n, p in student.lora.items()}
    save_draft(student, work / "run" / "draft.safetensors")  # adapters merged
    times["distill_s"] = round(time.perf_counter() - t1, 1)
    t2 = time.perf_counter()
    _say(f"{recipe.alias}: 3/3 writing {dst}", progress)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        exported = export_gguf(student.model, base, tmp, recipe.gguf_type)
        if adapters:  # the adapters alone, for `edge-client --draft-lora` on the unchanged base
            export_lora_gguf(adapters, recipe.lora_alpha, student.model.config, base, lora_file(dst))
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    times["export_s"] = round(time.perf_counter() - t2, 1)
    times["total_s"] = round(time.perf_counter() - t0, 1)
    info = {
        "alias": recipe.alias,
        "path": str(dst),
        "recipe": asdict(recipe),
        "evals": run["evals"],
        "loss": run["loss"],
        "rewritten_tensors": len(exported["rewritten"]),
        **times,
    }
    info_path.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return info


def _collect(recipe: Recipe, work: Path, split: Split, progress: bool) -> None:
    """The teacher's records: train, and held-out greedy (distill's evaluation) and at T 1
    (bench.speculators' second table), never trained on."""
    from shared.model import load_target

    teacher = load_target(recipe.teacher, progress=progress)
    train = CollectConfig(recipe.teacher, recipe.tokens, recipe.temperatures, 32, 0)
    held = replace(train, tokens=recipe.heldout_tokens or recipe.tokens, temperatures=(0.0,))
    held_t1 = replace(held, temperatures=(1.0,))
    sides = (
        ("train", "train", train, recipe.train_prompts),
        ("heldout", "heldout", held, recipe.heldout_prompts),
        ("heldout_t1", "heldout", held_t1, recipe.heldout_prompts),
    )
    for name, side, want, limit in sides:
        aside = set_aside_if_stale(work / name, manifest(want, teacher))
        if aside is not None:  # said even without progress: minutes of collecting start over
            print(f"{recipe.alias}: {name} holds records of other settings, kept as {aside}", file=sys.stderr)
        collect(work / name, _prompts(split, side, limit), want, recipe.collect_batch, teacher, progress)


def lora_file(path: Path) -> Path:
    """Where a LoRA recipe's adapters alone are written beside its merged file."""
    return path.with_name(path.name.removesuffix(".gguf") + ".lora.gguf")


def _say(text: str, progress: bool) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def default_aliases(pilots: bool = False) -> list[str]:
    """The recipes a plain `make drafts` builds (and the pilots with `pilots`)."""
    return [a for a, r in RECIPES.items() if pilots or not r.pilot]


def build_all(aliases: Sequence[str], **kw: Any) -> list[dict[str, Any]]:
    unknown = [a for a in aliases if a not in RECIPES]
    if unknown:
        raise ValueError(f"no recipe for {', '.join(unknown)}; recipes: {', '.join(RECIPES)}")
    return [build(RECIPES[a], **kw) for a in aliases]
