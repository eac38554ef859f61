"""Drafting defaults per draft model, from measurements on the pair they serve, and the shapes of
the CLI's repeated --draft (trees merged from several drafters).

A tree's best shape depends on what a drafter evaluation and a verify forward cost: SmolLM2's
self-draft runs at about the target's speed, while Qwen2.5-Coder-0.5B drafts for a 1.5B target
whose fp32 forward on one CPU core grows from ~0.5 s at 1 node to ~0.8 s at 16 (docs/results.md,
"The default pair on two cores"). A drafter evaluation costs about the same for one token or a few
(llama.cpp reads the weights once per batch), so depth, not width, is what a tree pays for on the
edge.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from edge_client.speculation.config import TreeSpec
from shared.tree import ExpansionConfig

# the expansion ⟨k1..km⟩ the CLI and the benches use when none is given
RECOMMENDED_TREES: dict[str, str] = {
    "qwen2.5-coder-0.5b-q4": "2,1,1,1,1,1,1,1",
    "qwen2.5-coder-0.5b-kd": "2,1,1,1,1,1,1,1",
    "smollm2-135m-q4": "1,1,3,1,1",
    "smollm2-135m-q4-l8": "1,1,3,1,1",
    "smollm2-135m-l8-kd": "1,1,3,1,1",
}
FALLBACK_TREE = "1,1,3,1,1,1,1,1"  # SpecInfer's ⟨1,1,3,1,1,1,1,1⟩


def recommended_tree(draft: str | Path) -> str:
    """The expansion config (as "k1,k2,...") recommended for a draft alias, or for an
    `edge-client export-onnx` folder of one (its manifest names the source); SpecInfer's default
    for anything else."""
    key = str(draft)
    if key not in RECOMMENDED_TREES:
        key = export_source(draft) or key
    return RECOMMENDED_TREES.get(key, FALLBACK_TREE)


def export_source(draft: str | Path) -> str | None:
    """The draft an ONNX export folder was made from (its manifest's `source`), else None."""
    manifest = Path(draft) / "manifest.json"
    try:
        source = json.loads(manifest.read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) else None


def parse_draft(text: str) -> tuple[str, TreeSpec | None]:
    """`MODEL[@SHAPE]` of a repeated --draft: the model and its shape (None: not given)."""
    model, at, shape = text.rpartition("@")
    if not at:
        return text, None
    kind, eq, value = shape.partition("=")
    try:
        if kind == "budget" and eq:
            if int(value) < 1:
                raise ValueError(f"a later draft's budget must be at least 1, got {value}")
            return model, TreeSpec("budget", budget=int(value))
        if kind == "sequence":
            return model, TreeSpec("sequence", depth=int(value) if eq else 0)
        return model, TreeSpec("static", ExpansionConfig.parse(shape))
    except ValueError as exc:
        raise ValueError(
            f"--draft {text}: bad shape {shape!r} ({exc}); use @K1,K2,..., @budget=N or @sequence=D"
        ) from None


def draft_specs(
    drafts: Sequence[str], first_shape: Callable[[str], TreeSpec]
) -> tuple[list[str], list[TreeSpec]]:
    """The models and tree shapes of every --draft: the first's from `first_shape(model)` (the
    CLI's --tree / --budget / --sequence), a later one's from its @SHAPE or its recommended tree."""
    parsed = [parse_draft(d) for d in drafts]
    if parsed[0][1] is not None:
        raise ValueError(f"--draft {drafts[0]}: shape the first draft with --tree, --budget or --sequence")
    models = [m for m, _ in parsed]
    specs = [first_shape(models[0])]
    for model, spec in parsed[1:]:
        specs.append(spec or TreeSpec("static", ExpansionConfig.parse(recommended_tree(model))))
    return models, specs
