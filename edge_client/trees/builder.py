"""The tree builder: a tree under construction, its options, and what a drafted tree carries.

Every shape (edge_client.trees.static, .dynamic, .lockstep) grows a `TreeBuilder` level by level,
evaluating each level in one drafter call, and returns a `DraftResult`: the TokenTree plus the
draft's own probabilities of each node and of the best alternatives after each node, which
outcome prediction needs (edge_client.speculation.outcomes).

Conditional trees (pre-speculation): `DraftOptions.cond` tokens are assumed after the committed
sequence. With `reuse_workspace` the drafter's workspace is kept (e.g. the tree still in flight)
and the tree is drafted below the workspace node that `cond` leads to, extending it where needed.

Two things keep pre-speculation off the critical path: a conditional tree whose assumed outcome
a verdict has ruled out is abandoned between evaluations (`DraftOptions.stop`, DraftCancelled),
and a tree sent without its leaves evaluated gets them later (`finish_leaves`), so the
synchronous draft after a miss is no longer than a plain one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edge_client.drafters.base import Drafter
from edge_client.trees.sampling import Coupling, Sampling, coupling_for, draft_mode, top_alternatives
from shared.messages import Mode
from shared.sparse import SparseDist, SparseRows
from shared.tree import Draws, TokenTree

DEFAULT_ALTERNATIVES = 4


class DraftCancelled(Exception):
    """Drafting was abandoned because `stop()` said so (the tree is no longer wanted)."""


@dataclass(frozen=True)
class DraftOptions:
    """How to draft one tree (every shape takes these; the shape's own sizes are separate).

    mode:            greedy / match rank the draft's tokens; mss / rrs sample (need sampling, rng)
    sampling:        the q-row transform stochastic modes draw from
    rng:             the generator stochastic modes draw with
    coupling:        mode match at temperature > 0: the coupled token leads each node's children
    cond:            tokens assumed after the committed sequence (a conditional tree)
    reuse_workspace: keep the drafter's workspace (it must be synced to exactly `committed`) and
                     draft below the node `cond` leads to, instead of syncing to committed + cond
    eval_leaves:     evaluate the last level too (its alternatives predict the bonus token)
    alternatives:    how many of the draft's most likely next tokens to record after each row
    stop:            asked before every drafter evaluation after the first; True abandons the
                     tree (DraftCancelled; the nodes already evaluated stay in the workspace)
    """

    mode: Mode | str = Mode.GREEDY  # kept as a Mode (__post_init__)
    sampling: Sampling | None = None
    rng: np.random.Generator | None = None
    coupling: Coupling | None = None
    cond: tuple[int, ...] = ()
    reuse_workspace: bool = False
    eval_leaves: bool = False
    alternatives: int = DEFAULT_ALTERNATIVES
    stop: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "cond", tuple(int(t) for t in self.cond))
        if self.alternatives < 1:
            raise ValueError(f"DraftOptions.alternatives must be at least 1, got {self.alternatives}")

    def replace(self, **changes: object) -> DraftOptions:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class DraftResult:
    """A drafted tree and what the draft believed about it.

    tree:           the TokenTree (base = len(committed), cond as given)
    node_prob:      [N] float32, draft probability of node i's token at its parent: softmax at
                    temperature 1 (deterministic modes) or the q weight / 2^16 it was drawn with
    path_prob:      [N] float32, product of node_prob along the root-to-node path; its sum is the
                    draft's estimate of the expected accepted length
    workspace_ids:  [N] int32, the drafter workspace node of each tree node; -1 for nodes never
                    evaluated (the last level, unless eval_leaves)
    root_id:        the workspace node the tree hangs below (-1: the committed end)
    alt_tokens:     [N + 1, A] int32, the draft's A most likely next tokens after row 0 (index 0)
                    and after node i (index i + 1), most likely first; -1 where not evaluated
    alt_probs:      [N + 1, A] float32, their probabilities (same distribution as node_prob)
    frontier_probs: [F] float32, descending path probabilities of the best candidates left out
                    (dynamic trees; sizes the next budget, see edge_client.speculation.budget)
    draft_ms:       wall time of drafting, sync included
    evaluations:    batched drafter evaluations made (extend calls)
    """

    tree: TokenTree
    node_prob: np.ndarray
    path_prob: np.ndarray
    workspace_ids: np.ndarray
    root_id: int
    alt_tokens: np.ndarray
    alt_probs: np.ndarray
    frontier_probs: np.ndarray
    draft_ms: float
    evaluations: int

    @property
    def expected_accepted(self) -> float:
        """Sum of path probabilities: the draft's own estimate of accepted tree tokens per round."""
        return float(self.path_prob.sum())

    def gains(self) -> np.ndarray:
        """[N + F] descending path probabilities of the tree's nodes and the left-out candidates."""
        return np.sort(np.concatenate([self.path_prob, self.frontier_probs]))[::-1]


def anchor_node(
    drafter: Drafter, committed: Sequence[int], cond: Sequence[int], reuse_workspace: bool
) -> tuple[int, np.ndarray]:
    """The workspace node the tree hangs below and the logits after it."""
    if not reuse_workspace:
        return -1, drafter.sync([*committed, *cond])
    if drafter.committed_len != len(committed) or drafter.committed_tokens() != [int(t) for t in committed]:
        raise ValueError("reuse_workspace needs the drafter synced to exactly `committed`")
    node, i = -1, 0
    while i < len(cond):
        child = drafter.find_child(node, int(cond[i]))
        if child is None:
            break
        node, i = child, i + 1
    rest = [int(t) for t in cond[i:]]
    if not rest:
        return node, drafter.logits_at(node)
    first = drafter.num_nodes
    out = drafter.extend([node] + [first + j for j in range(len(rest) - 1)], rest)  # the rest as one chain
    return first + len(rest) - 1, out[-1]


class TreeBuilder:
    """The tree under construction and its per-node draft information."""

    def __init__(self, alternatives: int) -> None:
        self.a = alternatives
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.node_logp: list[float] = []
        self.path_logp: list[float] = []
        self.ws: list[int] = []
        # row 0 (after the committed end / cond) first, then one row per node
        self.alt_tok: list[np.ndarray] = [np.full(alternatives, -1, dtype=np.int32)]
        self.alt_p: list[np.ndarray] = [np.zeros(alternatives, dtype=np.float32)]
        self.q_rows: list[SparseDist] = []
        self.d_node: list[int] = []
        self.d_qrow: list[int] = []
        self.child: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int, logp: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.node_logp.append(logp)
        self.path_logp.append(logp + (self.path_logp[parent] if parent >= 0 else 0.0))
        self.ws.append(-1)
        self.alt_tok.append(np.full(self.a, -1, dtype=np.int32))
        self.alt_p.append(np.zeros(self.a, dtype=np.float32))
        self.child[(parent, token)] = node
        return node

    def set_alt(self, row: int, ids: np.ndarray, probs: np.ndarray) -> None:
        """Alternatives after row `row` (0: row 0, i + 1: node i)."""
        n = min(self.a, ids.size)
        self.alt_tok[row][:n] = ids[:n]
        self.alt_p[row][:n] = probs[:n]

    def result(
        self,
        committed: Sequence[int],
        cond: Sequence[int],
        root_id: int,
        stochastic: bool,
        frontier: np.ndarray,
        t0: float,
        evaluations: int,
    ) -> DraftResult:
        draws = None
        if stochastic:
            draws = Draws(
                node=np.asarray(self.d_node, dtype=np.int32),
                drafter=np.zeros(len(self.d_node), dtype=np.int32),
                qrow=np.asarray(self.d_qrow, dtype=np.int32),
                q=SparseRows.from_rows(self.q_rows),
            )
        tree = TokenTree.build(self.tokens, self.parents, len(committed), cond, draws)
        return DraftResult(
            tree=tree,
            node_prob=np.exp(np.asarray(self.node_logp, dtype=np.float64)).astype(np.float32),
            path_prob=np.exp(np.asarray(self.path_logp, dtype=np.float64)).astype(np.float32),
            workspace_ids=np.asarray(self.ws, dtype=np.int32),
            root_id=root_id,
            alt_tokens=np.stack(self.alt_tok).astype(np.int32),
            alt_probs=np.stack(self.alt_p).astype(np.float32),
            frontier_probs=frontier.astype(np.float32),
            draft_ms=(time.perf_counter() - t0) * 1e3,
            evaluations=evaluations,
        )


def evaluate_level(
    drafter: Drafter, acc: TreeBuilder, nodes: list[int], root_id: int
) -> list[tuple[int, np.ndarray]]:
    """Evaluate tree nodes in one drafter call; their parents must be evaluated already."""
    if not nodes:
        return []
    first = drafter.num_nodes
    parents = [root_id if acc.parents[n] < 0 else acc.ws[acc.parents[n]] for n in nodes]
    out = drafter.extend(parents, [acc.tokens[n] for n in nodes])  # [len(nodes), V]
    for j, n in enumerate(nodes):
        acc.ws[n] = first + j
    return [(n, out[j]) for j, n in enumerate(nodes)]


def check_stop(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise DraftCancelled("drafting stopped: the tree is no longer wanted")


def finish_leaves(
    drafter: Drafter,
    dr: DraftResult,
    opts: DraftOptions | None = None,
    nodes: Sequence[int] | None = None,
) -> DraftResult:
    """Evaluate the nodes of `dr` left unevaluated (its leaves) in one drafter call and return the
    result with their workspace ids and alternatives filled in, as if drafted with eval_leaves.

    nodes: only these of the unevaluated nodes (default: all of them); the others stay
    unevaluated (workspace id -1, no alternatives), and a later call can still add them.

    The drafter's workspace must still hold the tree (no sync since it was drafted). The tree
    itself (tokens, draws) is unchanged; only what the draft believes after the leaves is added.
    opts: the mode, sampling and coupling the tree was drafted with.
    Raises WorkspaceFullError when the leaves do not fit.
    """
    (out,) = finish_leaves_many(drafter, [(dr, nodes)], opts)
    return out


def finish_leaves_many(
    drafter: Drafter,
    work: Sequence[tuple[DraftResult, Sequence[int] | None]],
    opts: DraftOptions | None = None,
) -> list[DraftResult]:
    """`finish_leaves` for several trees of the workspace at once: all their leaves in ONE drafter
    call (a llama.cpp evaluation costs about the same for one token or a few)."""
    opts = opts or DraftOptions()
    sampling = opts.sampling
    m = draft_mode(opts.mode)
    if m.stochastic and sampling is None:
        raise ValueError(f"mode {m.value} samples: pass sampling=Sampling(...)")
    coupling = coupling_for(m, opts.coupling)
    plans: list[tuple[DraftResult, np.ndarray, list[int]]] = []
    parents: list[int] = []
    tokens: list[int] = []
    for dr, wanted in work:
        ws = dr.workspace_ids.copy()
        if wanted is None:
            nodes = np.flatnonzero(ws < 0).tolist()
        else:
            nodes = sorted({int(n) for n in wanted})
            bad = [n for n in nodes if not 0 <= n < ws.size or ws[n] >= 0]
            if bad:
                raise ValueError(f"finish_leaves: nodes {bad} are not unevaluated nodes of the tree")
        tree = dr.tree
        if any(tree.parents[n] >= 0 and ws[tree.parents[n]] < 0 for n in nodes):
            raise ValueError("finish_leaves: a node's parent was never evaluated (not a leaf)")
        parents.extend(dr.root_id if tree.parents[n] < 0 else int(ws[tree.parents[n]]) for n in nodes)
        tokens.extend(int(tree.tokens[n]) for n in nodes)
        plans.append((dr, ws, nodes))
    if not tokens:
        return [dr for dr, _ in work]
    first = drafter.num_nodes
    out = drafter.extend(parents, tokens)
    results: list[DraftResult] = []
    row = 0
    for dr, ws, nodes in plans:
        if not nodes:
            results.append(dr)
            continue
        tree = dr.tree
        alt_tok, alt_p = dr.alt_tokens.copy(), dr.alt_probs.copy()
        a = alt_tok.shape[1]
        for n in nodes:
            ws[n] = first + row
            at = tree.committed_len + int(tree.depth[n])  # absolute position of the token after node n
            ids, probs = top_alternatives(out[row], a, sampling if m.stochastic else None, coupling, at)
            row += 1
            k = min(a, ids.size)
            alt_tok[n + 1, :] = -1
            alt_p[n + 1, :] = 0.0
            alt_tok[n + 1, :k] = ids[:k]
            alt_p[n + 1, :k] = probs[:k]
        results.append(
            dataclasses.replace(
                dr,
                workspace_ids=ws,
                alt_tokens=alt_tok,
                alt_probs=alt_p.astype(np.float32),
                evaluations=dr.evaluations + 1,
            )
        )
    return results
