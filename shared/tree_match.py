"""Matching a conditional tree against the committed sequence S (PROTOCOL.md section 5).

A conditional tree matches S when `base + len(cond) == len(S)` and `S[base:] == cond`
(`tree_matches`), and may still match as S grows (`can_still_match`): both sides of the session
protocol decide with these. A deterministic tree the committed sequence has grown into along one
of its paths re-roots there (`reroot`, `can_grow_into`); `rebase` moves a tree's base forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.tree import TokenTree


def tree_matches(tree: TokenTree, committed: Sequence[int] | np.ndarray) -> bool:
    """PROTOCOL.md section 5: base + len(cond) == len(S) and S[base:] == cond."""
    n = len(committed)
    if tree.committed_len != n or tree.base > n:
        return False
    return bool(
        np.array_equal(np.asarray(committed[tree.base :], dtype=np.int64), tree.cond.astype(np.int64))
    )


def can_still_match(tree: TokenTree, committed: Sequence[int] | np.ndarray, growing: bool) -> bool:
    """Whether `tree` matches S now or may match once S grows (growing: a round is in flight).

    A round in flight always adds at least one token, so while one is in flight a tree for the
    current length is already dead.
    """
    n = len(committed)
    if tree.base > n:
        return False
    known = np.asarray(committed[tree.base :], dtype=np.int64)
    cond = tree.cond.astype(np.int64)
    if known.size > cond.size or not np.array_equal(cond[: known.size], known):
        return False
    if known.size == cond.size:
        return not growing
    return True


def reroot_path(tree: TokenTree, committed: Sequence[int] | np.ndarray) -> int | None:
    """The node at which the committed tokens past the tree's assumption leave off, walking from
    row 0 (-1: none are past it, the tree matches as sent), or None when the committed sequence
    contradicts the tree (its cond, or no path of its nodes spells the tokens past it)."""
    n, k = len(committed), tree.committed_len
    if tree.base > n or k > n:
        return None
    if not np.array_equal(np.asarray(committed[tree.base : k], dtype=np.int64), tree.cond.astype(np.int64)):
        return None
    node = -1
    for t in np.asarray(committed[k:n], dtype=np.int64).tolist():
        nxt = [c for c in tree.children_of(node) if int(tree.tokens[c]) == t]
        if not nxt:
            return None
        node = nxt[0]
    return node


def reroot(tree: TokenTree, committed: Sequence[int] | np.ndarray) -> tuple[TokenTree, np.ndarray] | None:
    """A deterministic tree re-rooted where the committed sequence has grown along one of its
    paths (PROTOCOL.md section 5): the nodes below that path's end, as a tree for the committed
    sequence (cond extended by the path's tokens; every node keeps its absolute position), and
    [M] the original index of each of its nodes. The tree itself (and every index) when it matches
    as sent; None when the sequence contradicts it or the path's end has no nodes below it.

    Verifying any set of guesses is exact in greedy and match, so a subtree is as good a round as
    the tree it came from; stochastic trees (draws, q rows) are never re-rooted."""
    node = reroot_path(tree, committed)
    if node is None or tree.is_stochastic:
        return None if node is None or node != -1 else (tree, np.arange(tree.num_nodes))
    if node == -1:
        return tree, np.arange(tree.num_nodes)
    keep: list[int] = []
    inside = {node}
    for i, p in enumerate(tree.parents.tolist()):  # parents precede children: one pass finds them
        if p in inside:
            inside.add(i)
            keep.append(i)
    if not keep:
        return None
    new_index = {old: j for j, old in enumerate(keep)}
    parents = [-1 if int(tree.parents[i]) == node else new_index[int(tree.parents[i])] for i in keep]
    n = len(committed)
    sub = TokenTree(
        tree.tokens[keep].astype(np.int32),
        np.asarray(parents, dtype=np.int32),
        tree.base,
        np.asarray(committed[tree.base : n], dtype=np.int32),
    )
    return sub, np.asarray(keep, dtype=np.int64)


def can_grow_into(tree: TokenTree, committed: Sequence[int] | np.ndarray) -> bool:
    """A deterministic tree the committed sequence has not contradicted yet that may still re-root
    (`reroot`) after the round in flight: that round adds at least one token, so below the point
    the sequence has reached the tree needs a node with a child."""
    if tree.is_stochastic or tree.committed_len > len(committed):
        return False
    node = reroot_path(tree, committed)
    return node is not None and any(tree.children_of(c) for c in tree.children_of(node))


def rebase(tree: TokenTree, known: int) -> TokenTree:
    """The same tree with `base` moved forward to `known` committed tokens (cond shortened).

    Valid when the first known - base tokens of cond are committed; positions do not change.
    """
    shift = known - tree.base
    if shift <= 0:
        return tree
    if shift > tree.cond.size:
        raise ValueError(f"cannot rebase: {shift} tokens past base but cond holds {tree.cond.size}")
    return TokenTree(tree.tokens, tree.parents, known, tree.cond[shift:], tree.draws)
