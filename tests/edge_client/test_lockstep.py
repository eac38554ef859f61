"""Conditional trees drafted in lockstep equal the trees drafted one by one, in fewer evaluations."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.drafters import WorkspaceFullError
from edge_client.trees import (
    Coupling,
    DraftCancelled,
    DraftOptions,
    draft_static,
    draft_static_many,
    finish_leaves,
    finish_leaves_many,
)
from shared.messages import Mode
from shared.tree import ExpansionConfig
from tests.edge_client.fake_drafter import FakeDrafter

V = 64
S = [3, 14, 15, 9, 26, 5]


def _outcome_conds(d: FakeDrafter) -> list[tuple[int, ...]]:
    """A tree in flight and three outcomes of it: full acceptance with the draft's bonus, a
    rejection at depth 1 with a second-choice bonus, and one at the root."""
    first = draft_static(d, S, ExpansionConfig((1, 1, 1)), DraftOptions(eval_leaves=True))
    leaf = first.tree.leaves()[0]
    path = first.tree.path_tokens(leaf)
    return [
        (*path, int(first.alt_tokens[leaf + 1, 0])),
        (path[0], int(first.alt_tokens[1, 1])),
        (int(first.alt_tokens[0, 1]),),
    ]


@pytest.mark.parametrize("config", [(1, 1, 1, 1), (2, 1, 1), (1, 3, 1)])
@pytest.mark.parametrize("mode", ["greedy", "match"])
def test_lockstep_trees_equal_trees_drafted_alone(config: tuple[int, ...], mode: str) -> None:
    cfg = ExpansionConfig(config)
    coupling = Coupling(seed=7, temperature=0.8) if mode == "match" else None
    alone_d, many_d = FakeDrafter(V), FakeDrafter(V)
    conds = _outcome_conds(alone_d)
    assert _outcome_conds(many_d) == conds
    alone = [
        draft_static(
            alone_d, S, cfg, DraftOptions(cond=c, reuse_workspace=True, mode=mode, coupling=coupling)
        )
        for c in conds
    ]
    calls = many_d.stats.extend_calls
    many = draft_static_many(many_d, S, cfg, conds, DraftOptions(mode=mode, coupling=coupling))
    # one evaluation for the bonus chains, then one per evaluated level (not one per tree)
    assert many_d.stats.extend_calls - calls == 1 + cfg.depth - 1
    for a, b in zip(alone, many, strict=True):
        assert b is not None
        assert np.array_equal(a.tree.tokens, b.tree.tokens) and np.array_equal(a.tree.parents, b.tree.parents)
        assert a.tree.base == b.tree.base and np.array_equal(a.tree.cond, b.tree.cond)
        assert np.allclose(a.path_prob, b.path_prob) and np.array_equal(a.alt_tokens, b.alt_tokens)
        assert many_d.path_to(b.root_id)  # hangs below its cond in the workspace
    # the leaves of all of them in one evaluation, as finish_leaves gives them one by one
    calls = many_d.stats.extend_calls
    done = finish_leaves_many(
        many_d, [(b, None) for b in many if b is not None], DraftOptions(mode=mode, coupling=coupling)
    )
    assert many_d.stats.extend_calls - calls == 1
    for a, b in zip(alone, done, strict=True):
        ref = finish_leaves(alone_d, a, DraftOptions(mode=mode, coupling=coupling))
        assert np.array_equal(ref.alt_tokens, b.alt_tokens) and bool((b.workspace_ids >= 0).all())


def test_a_stopped_tree_is_dropped_and_the_others_go_on() -> None:
    d = FakeDrafter(V)
    conds = _outcome_conds(d)
    asked = [0]

    def second_gone() -> bool:
        asked[0] += 1
        return asked[0] >= 2  # wanted for the first level only

    out = draft_static_many(d, S, ExpansionConfig((1, 1, 1)), conds, stops=[None, second_gone, None])
    assert out[0] is not None and out[1] is None and out[2] is not None
    with pytest.raises(DraftCancelled):
        draft_static_many(d, S, ExpansionConfig((1, 1)), conds, stops=[lambda: True] * 3)


def test_refusals() -> None:
    d = FakeDrafter(V, max_nodes=12)
    conds = _outcome_conds(d)
    held = d.num_nodes
    with pytest.raises(WorkspaceFullError):
        draft_static_many(d, S, ExpansionConfig((1, 1, 1, 1)), conds)
    assert d.num_nodes == held  # nothing added
    with pytest.raises(ValueError, match="greedy/match"):
        draft_static_many(d, S, ExpansionConfig((1,)), conds, DraftOptions(mode=Mode.MSS))
    with pytest.raises(ValueError, match="synced"):
        draft_static_many(d, S[:-1], ExpansionConfig((1,)), conds)
