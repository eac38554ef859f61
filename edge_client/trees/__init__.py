"""Token-tree builders: what the edge drafts each round (docs/architecture.md §3 and §6).

One concept per module:

- `sampling`: how a row of draft logits becomes candidate tokens (ranking, coupling, q rows,
  Saguaro sampling);
- `builder`: the tree under construction, `DraftOptions`, `DraftResult`, and the static shapes
  (SpecInfer's expansion ⟨k1..km⟩ and the chain ⟨1,...,1⟩), the default round's tree;
- `dynamic`: best-first under a node budget (Sequoia / EAGLE-2 style);
- `lockstep`: pre-speculation's batched drafter work: several conditional trees (static, sampled
  or dynamic) drafted together, one evaluation per level, and the leaves of trees already sent,
  finished later.
"""

from __future__ import annotations

from edge_client.trees.builder import (
    DEFAULT_ALTERNATIVES,
    DraftCancelled,
    DraftOptions,
    DraftResult,
    draft_sequence,
    draft_static,
)
from edge_client.trees.dynamic import draft_dynamic
from edge_client.trees.lockstep import (
    draft_dynamic_many,
    draft_static_many,
    finish_leaves,
    finish_leaves_many,
)
from edge_client.trees.sampling import WIRE_TOP_K, Coupling, Saguaro, Sampling

__all__ = [
    "DEFAULT_ALTERNATIVES",
    "WIRE_TOP_K",
    "Coupling",
    "DraftCancelled",
    "DraftOptions",
    "DraftResult",
    "Saguaro",
    "Sampling",
    "draft_dynamic",
    "draft_dynamic_many",
    "draft_sequence",
    "draft_static",
    "draft_static_many",
    "finish_leaves",
    "finish_leaves_many",
]
