"""Trees merged from several drafters: SpecInfer's Definition 3.2 at the edge.

Each drafter drafts its own tree below the same committed sequence (and `cond`); the merged tree
is the union of their root-to-node paths (shared.tree.merge). In greedy / match identical paths
become one node. In mss / rrs a node may be shared but every draw is kept, in drafter order and
each drafter's in its own order, with its own q rows and its drafter id (Draws.drafter), so the
verifier applies one residual update per draw against the q row it was drawn from.

The merged DraftResult keeps the first drafter's view of the workspace: the first tree's nodes
keep their indices and workspace ids (the core evaluates their leaves and replays them in the
first drafter's workspace); nodes only other drafters drew carry NOT_IN_WORKSPACE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from edge_client.trees.builder import DraftResult
from shared.tree import TokenTree, merge

# workspace id of a merged node that is not in the first drafter's workspace (-1: not evaluated)
NOT_IN_WORKSPACE = -2


def tag_drafter(tree: TokenTree, drafter: int) -> TokenTree:
    """`tree` with every draw marked as drawn by drafter `drafter` (a no-op without draws)."""
    if tree.draws is None:
        return tree
    ids = np.full(tree.draws.node.size, drafter, dtype=np.int32)
    return dataclasses.replace(tree, draws=dataclasses.replace(tree.draws, drafter=ids))


def node_maps(trees: Sequence[TokenTree]) -> list[np.ndarray]:
    """For each tree, the merged node of each of its nodes (the same walk as shared.tree.merge)."""
    index: dict[tuple[int, int], int] = {}
    maps: list[np.ndarray] = []
    for t in trees:
        remap = np.empty(t.num_nodes, dtype=np.int64)
        for i, (tok, p) in enumerate(zip(t.tokens.tolist(), t.parents.tolist(), strict=True)):
            key = (-1 if p < 0 else int(remap[p]), int(tok))
            remap[i] = index.setdefault(key, len(index))
        maps.append(remap)
    return maps


def merge_drafts(results: Sequence[DraftResult]) -> DraftResult:
    """One DraftResult for the merged tree of several drafters' results (drafter i = results[i]).

    Per-node draft information (node and path probabilities, alternatives) comes from the first
    drafter that drew the node; draft_ms and evaluations add up (the drafters run in turn).
    """
    if not results:
        raise ValueError("merge_drafts needs at least one draft")
    if len(results) == 1:
        return results[0]
    trees = [tag_drafter(r.tree, i) for i, r in enumerate(results)]
    tree = merge(trees)
    maps = node_maps(trees)
    first = results[0]
    if not np.array_equal(maps[0], np.arange(first.tree.num_nodes)):
        raise ValueError("the first drafter's tree repeats a path: it cannot lead a merged tree")
    n = tree.num_nodes
    a = max(r.alt_tokens.shape[1] for r in results)
    node_prob = np.zeros(n, dtype=np.float32)
    path_prob = np.zeros(n, dtype=np.float32)
    alt_tokens = np.full((n + 1, a), -1, dtype=np.int32)
    alt_probs = np.zeros((n + 1, a), dtype=np.float32)
    for r, m in reversed(list(zip(results, maps, strict=True))):  # the first drafter's values win
        k = r.alt_tokens.shape[1]
        node_prob[m] = r.node_prob
        path_prob[m] = r.path_prob
        alt_tokens[m + 1, :k] = r.alt_tokens[1:]
        alt_probs[m + 1, :k] = r.alt_probs[1:]
    alt_tokens[0, : first.alt_tokens.shape[1]] = first.alt_tokens[0]
    alt_probs[0, : first.alt_probs.shape[1]] = first.alt_probs[0]
    ws = np.full(n, NOT_IN_WORKSPACE, dtype=np.int32)
    ws[: first.tree.num_nodes] = first.workspace_ids
    frontier = np.sort(np.concatenate([r.frontier_probs for r in results]))[::-1]
    return DraftResult(
        tree=tree,
        node_prob=node_prob,
        path_prob=path_prob,
        workspace_ids=ws,
        root_id=first.root_id,
        alt_tokens=alt_tokens,
        alt_probs=alt_probs,
        frontier_probs=frontier.astype(np.float32),
        draft_ms=float(sum(r.draft_ms for r in results)),
        evaluations=sum(r.evaluations for r in results),
        # the first drafter's rows win, and its nodes keep their indices (maps[0] is the identity):
        # its coupled rows' landing records stay valid in the merged tree
        landing_rows=first.landing_rows,
        landing=first.landing,
    )


__all__ = ["NOT_IN_WORKSPACE", "merge_drafts", "node_maps", "tag_drafter"]
