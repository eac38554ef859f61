"""The load bench's prompt-lookup proposer: which continuations it picks and the trees it builds."""

from __future__ import annotations

import random

import pytest

from bench.serving.proposer import LookupConfig, continuations, propose


def test_longest_then_most_recent_match_first() -> None:
    # suffix "1 2 3" occurs at 1 (followed by 9) and at 5 (followed by 7 4): the recent one wins
    ctx = [5, 1, 2, 3, 9, 1, 2, 3, 7, 4, 1, 2, 3]
    found = list(continuations(ctx, LookupConfig(depth=3)))
    assert found[0] == [7, 4, 1] and found[1] == [9, 1, 2]
    # a longer n-gram beats a more recent shorter one: "8 3" only occurs at 0
    ctx = [8, 3, 6, 3, 5, 8, 3]
    assert next(continuations(ctx, LookupConfig(depth=1, max_ngram=2))) == [6]


def test_a_match_running_into_the_end_copies_on_periodically() -> None:
    ctx = [4, 1, 2, 1, 2, 1]
    assert next(continuations(ctx, LookupConfig(depth=5))) == [2, 1, 2, 1, 2]


def test_tree_is_a_chain_plus_a_second_branch_within_the_budget() -> None:
    ctx = [5, 1, 2, 3, 9, 1, 2, 3, 7, 4, 1, 2, 3]
    tree = propose(ctx, LookupConfig(nodes=10, depth=6))
    assert tree.base == len(ctx) and tree.cond.size == 0
    assert tree.num_nodes == 10 and tree.max_depth == 6
    paths = {tuple(tree.path_tokens(leaf)) for leaf in tree.leaves()}
    assert paths == {(7, 4, 1, 2, 3, 7), (9, 1, 2, 3)}
    tree.validate(vocab_size=16, max_nodes=10, max_depth=6, stochastic=False)


def test_no_match_falls_back_to_the_recent_tokens() -> None:
    tree = propose([1, 2, 3, 4, 5], LookupConfig(nodes=4, depth=3))
    assert tree.tokens.tolist() == [3, 4, 5] and tree.parents.tolist() == [-1, 0, 1]
    assert propose([7]).tokens.tolist() == [7]


@pytest.mark.parametrize("seed", range(20))
def test_random_contexts_give_valid_trees_within_limits(seed: int) -> None:
    rng = random.Random(seed)
    cfg = LookupConfig(nodes=rng.randint(1, 16), depth=rng.randint(1, 10), max_ngram=rng.randint(1, 4))
    ctx = [rng.randrange(6) for _ in range(rng.randint(1, 60))]
    tree = propose(ctx, cfg)
    assert 1 <= tree.num_nodes <= cfg.nodes and tree.max_depth <= cfg.depth
    tree.validate(6, cfg.nodes, cfg.depth, stochastic=False)  # siblings distinct, parents earlier


def test_bad_config_and_empty_context_are_refused() -> None:
    with pytest.raises(ValueError):
        LookupConfig(nodes=0)
    with pytest.raises(ValueError):
        propose([])
