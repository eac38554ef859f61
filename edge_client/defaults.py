"""Drafting defaults per draft model, from measurements on the pair they serve.

A tree's best shape depends on what a drafter evaluation and a verify forward cost: SmolLM2's
self-draft runs at about the target's speed, while Qwen2.5-Coder-0.5B drafts for a 1.5B target
whose fp32 forward on one CPU core grows from ~0.5 s at 1 node to ~0.8 s at 16 (README, bench
figures). A drafter evaluation costs about the same for one token or a few (llama.cpp reads the
weights once per batch), so depth, not width, is what a tree pays for on the edge.
"""

from __future__ import annotations

from pathlib import Path

# the expansion ⟨k1..km⟩ the CLI and the benches use when none is given
RECOMMENDED_TREES: dict[str, str] = {
    "qwen2.5-coder-0.5b-q4": "2,1,1,1,1,1,1,1",
    "smollm2-135m-q4": "1,1,3,1,1",
    "smollm2-135m-q4-l8": "1,1,3,1,1",
}
FALLBACK_TREE = "1,1,3,1,1,1,1,1"  # SpecInfer's ⟨1,1,3,1,1,1,1,1⟩


def recommended_tree(draft: str | Path) -> str:
    """The expansion config (as "k1,k2,...") recommended for a draft alias; SpecInfer's default
    for anything else."""
    return RECOMMENDED_TREES.get(str(draft), FALLBACK_TREE)
