"""Token-tree builders: what the edge drafts each round (DESIGN sections 3.1 and 6).

Three shapes, all drafted level by level so that each drafter evaluation (one llama_decode)
covers a whole level of the tree:

- static expansion ⟨k1..km⟩ (SpecInfer): every node at depth i-1 gets k_i children;
- a "sequence" draft: ⟨1,...,1⟩, a chain as deep as the tree (the baseline trees are compared to);
- dynamic best-first under a node budget: the tree holds the nodes of highest path probability
  (Sequoia / EAGLE-2 style), expanded in batches (see `draft_dynamic`).

Deterministic modes (greedy, match) take the draft's top-k_i tokens at each node (distinct
siblings), ranked by its logits (temperature 1). Stochastic modes (mss, rrs) sample: at each node
the draft distribution at the requested temperature / top-k / top-p is truncated to at most
`Sampling.wire_top_k` tokens and quantized to u16 weights FIRST (shared.sparse), then exactly k_i
draws are taken from those weights (with replacement for mss; without, by Gumbel-top-k, for rrs)
and the rows travel with the tree. The number of draws at a node is fixed before drawing and no
draw is dropped; duplicate mss draws share one node and stay separate draws (DESIGN 3.1).

Conditional trees (pre-speculation): `cond` tokens are assumed after the committed sequence. With
`reuse_workspace=True` the drafter's workspace is kept (e.g. the tree still in flight) and the
tree is drafted below the workspace node that `cond` leads to, extending it where needed.

Pre-speculation also needs two things off the critical path: a conditional tree whose assumed
outcome a verdict has ruled out is abandoned between evaluations (`stop`, DraftCancelled), and a
tree sent without its leaves evaluated gets them later (`finish_leaves`), so the synchronous
draft after a miss is no longer than a plain one.

Every builder returns a DraftResult: the TokenTree plus the draft's own probabilities of each node
and of the best alternatives after each node, which outcome prediction needs.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_client.drafters.base import Drafter, WorkspaceFullError
from shared.keyed import BELOW_ONE, keyed_uniforms
from shared.messages import Mode
from shared.sparse import SparseDist, SparseRows, quantize, truncate
from shared.temperature import tempered
from shared.tree import Draws, ExpansionConfig, TokenTree


class DraftCancelled(Exception):
    """Drafting was abandoned because `stop()` said so (the tree is no longer wanted)."""


WIRE_TOP_K = 48  # default cap on q-row length: ~6 bytes a token on the wire, ~0.3 KB a row
DEFAULT_ALTERNATIVES = 4


@dataclass(frozen=True)
class Sampling:
    """What the target is asked to do; stochastic trees draw from the same transform of the draft.

    temperature, top_k (0: all), top_p: applied to the draft logits as the target applies them
    wire_top_k: the most tokens a q row keeps (bounds bytes per round); the top_p mass is taken
                over the top_k set first, then the row is cut to wire_top_k tokens
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    wire_top_k: int = WIRE_TOP_K

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("stochastic drafting needs temperature > 0 (temperature 0 is mode greedy)")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or self.wire_top_k < 1:
            raise ValueError("need 0 < top_p <= 1, top_k >= 0, wire_top_k >= 1")

    def q_row(self, logits: np.ndarray) -> SparseDist:
        """The quantized draft row q for logits [V]: the edge samples from exactly these weights."""
        p = _softmax(tempered(logits.astype(np.float64), self.temperature))
        idx = truncate(p, self.top_k, self.top_p)[: self.wire_top_k]
        w = quantize(p[idx])
        order = np.argsort(idx, kind="stable")
        return SparseDist(idx[order].astype(np.int32), w[order])


@dataclass(frozen=True)
class Coupling:
    """Sample-and-match drafting with the target's own randomness (mode match at temperature > 0).

    The verifier samples the token at absolute position `pos` by inverse CDF of its p at
    `keyed_uniform(seed, pos)` (shared.keyed), and the edge chose the seed. Drafting with the same
    uniform on the draft's distribution (the same temperature / top-k / top-p, the CDF in token-id
    order) proposes the token the target will sample wherever the two distributions are close: at
    every node the coupled token becomes the first child, ahead of the draft's most likely ones.
    Nothing about exactness changes (the verifier samples from p whatever the tree); only what the
    edge guesses does. The edge's outcome model then treats the coupled token as the draft's
    "top" token (edge_client.prespec.ChoiceModel), as greedy verification does the argmax.
    """

    seed: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("coupling needs temperature > 0 (temperature 0 is greedy)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need 0 < top_p <= 1 and top_k >= 0")

    def token(self, logits: np.ndarray, position: int) -> int:
        """The draft's token at absolute `position` by inverse CDF at the keyed uniform there."""
        p = _softmax(tempered(logits.astype(np.float64), self.temperature))
        if self.top_k > 0 or self.top_p < 1:
            keep = np.sort(truncate(p, self.top_k, self.top_p))  # token-id order, as the target's CDF
            cdf = np.cumsum(p[keep])
        else:
            keep, cdf = None, np.cumsum(p)
        u = float(keyed_uniforms(self.seed, position))
        i = int(np.searchsorted(cdf, min(u * cdf[-1], cdf[-1] * BELOW_ONE), side="right"))
        i = min(i, cdf.size - 1)
        return int(keep[i]) if keep is not None else i


def _ranked(
    logits: np.ndarray, k: int, coupling: Coupling | None, position: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k candidate tokens after logits [V], best first, with their log-probabilities at
    temperature 1: the draft's most likely ones, or with `coupling` the coupled token first."""
    ids, vals = _top_logp(logits, k)
    if coupling is None:
        return ids, vals
    c = coupling.token(logits, position)
    hit = np.flatnonzero(ids == c)
    if hit.size:
        j = int(hit[0])
        order = np.r_[j, np.delete(np.arange(ids.size), j)]
        return ids[order], vals[order]
    lp_c = float(logits[c]) - float(logits[ids[0]]) + float(vals[0])  # log-softmax via the top one
    return np.r_[c, ids[:-1]].astype(ids.dtype), np.r_[lp_c, vals[:-1]]


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
                    (dynamic trees; sizes the next budget, see edge_client.budget)
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


# ---------------------------------------------------------------------------------- helpers
def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top_logp(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens after logits [V] at temperature 1, most likely first:
    (ids [k] int64, log-probabilities [k] float64). Ranks the raw logits (argpartition, O(V)) and
    normalizes only the chosen ones: no full-vocabulary softmax or sort."""
    k = min(k, logits.size)
    idx = np.argpartition(logits, logits.size - k)[logits.size - k :]  # no negated copy of the row
    idx = idx[np.argsort(-logits[idx], kind="stable")]
    m = float(logits[idx[0]])
    lse = m + math.log(float(np.exp(logits - np.float32(m)).sum(dtype=np.float64)))
    return idx, logits[idx].astype(np.float64) - lse


def _mode(mode: Mode | str) -> Mode:
    m = Mode(mode)
    if m is Mode.AR:
        raise ValueError("mode ar is target-only decoding: it drafts no tree")
    return m


def _anchor(
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


class _Acc:
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


# ---------------------------------------------------------------------------------- static
def draft_static(
    drafter: Drafter,
    committed: Sequence[int],
    config: ExpansionConfig = ExpansionConfig(),
    *,
    mode: Mode | str = Mode.GREEDY,
    sampling: Sampling | None = None,
    rng: np.random.Generator | None = None,
    cond: Sequence[int] = (),
    reuse_workspace: bool = False,
    eval_leaves: bool = False,
    alternatives: int = DEFAULT_ALTERNATIVES,
    stop: Callable[[], bool] | None = None,
    coupling: Coupling | None = None,
) -> DraftResult:
    """SpecInfer's expansion-based tree ⟨k1..km⟩, one drafter evaluation per level.

    Deterministic modes: node order is ExpansionConfig.parents() (level by level, siblings by
    rank), so the tree has exactly config.num_nodes nodes. Stochastic modes: each node at depth
    i-1 makes exactly k_i draws (rrs: min(k_i, row length), known before drawing); identical mss
    draws share a node, so the tree may have fewer nodes than config.num_nodes, never fewer draws.
    The last level is not evaluated unless `eval_leaves` (pre-speculation wants its alternatives;
    `finish_leaves` can add them after the tree is sent). `stop` is asked before every drafter
    evaluation after the first; when it returns True, DraftCancelled is raised (the nodes already
    evaluated stay in the workspace). `coupling` (mode match): the coupled token leads each node's
    children (see Coupling).
    """
    t0 = time.perf_counter()
    m = _mode(mode)
    stochastic = m.stochastic
    coupling = _coupling(m, coupling)
    at = len(committed) + len(cond)  # absolute position of the token after row 0
    if stochastic:
        if sampling is None or rng is None:
            raise ValueError(f"mode {m.value} samples: pass sampling=Sampling(...) and rng")
    _check_room(drafter, config, eval_leaves, fresh=not reuse_workspace)
    evals = drafter.stats.extend_calls
    root_id, root_logits = _anchor(drafter, committed, cond, reuse_workspace)
    acc = _Acc(alternatives)
    frontier: list[tuple[int, np.ndarray]] = [(-1, root_logits)]  # (tree node, logits after it)
    for level, k in enumerate(config.ks):
        new: list[int] = []
        for node, logits in frontier:
            if stochastic:
                assert sampling is not None and rng is not None
                new.extend(_sample_children(acc, node, logits, k, m, sampling, rng))
            else:
                ids, vals = _ranked(logits, max(k, alternatives), coupling, at + level)
                acc.set_alt(node + 1, ids, np.exp(vals))
                for tok, lp in zip(ids[:k].tolist(), vals[:k].tolist(), strict=True):
                    new.append(acc.add(node, tok, lp))
        last = level == config.depth - 1
        if last and not eval_leaves:
            break
        _check_stop(stop)
        frontier = _evaluate(drafter, acc, new, root_id)
    if eval_leaves:  # alternatives after the leaves
        for node, logits in frontier:
            q = sampling if stochastic else None
            acc.set_alt(node + 1, *_alternatives(logits, alternatives, q, coupling, at + config.depth))
    evals = drafter.stats.extend_calls - evals
    return acc.result(committed, cond, root_id, stochastic, np.zeros(0), t0, evals)


def draft_sequence(drafter: Drafter, committed: Sequence[int], depth: int, **options: Any) -> DraftResult:
    """A chain as deep as the tree: ⟨1,...,1⟩ of `depth` levels (same options as draft_static)."""
    return draft_static(drafter, committed, ExpansionConfig((1,) * depth), **options)


def _sample_children(
    acc: _Acc,
    node: int,
    logits: np.ndarray,
    k: int,
    mode: Mode,
    sampling: Sampling,
    rng: np.random.Generator,
) -> list[int]:
    """Exactly k draws (rrs: min(k, row length)) at `node` from its quantized q row; new nodes."""
    q = sampling.q_row(logits)
    qrow = len(acc.q_rows)
    acc.q_rows.append(q)
    order = np.argsort(-q.weights, kind="stable")
    acc.set_alt(node + 1, q.ids[order], q.weights[order] / 65536.0)
    if mode is Mode.RRS:
        drawn = q.sample_without_replacement(rng, min(k, len(q)))
    else:
        drawn = q.sample(rng, k)
    new: list[int] = []
    for tok in drawn.tolist():
        child = acc.child.get((node, tok))
        if child is None:
            child = acc.add(node, tok, math.log(q.weight(tok) / 65536.0))
            new.append(child)
        acc.d_node.append(child)
        acc.d_qrow.append(qrow)
    return new


def _evaluate(drafter: Drafter, acc: _Acc, nodes: list[int], root_id: int) -> list[tuple[int, np.ndarray]]:
    """Evaluate tree nodes in one drafter call; their parents must be evaluated already."""
    if not nodes:
        return []
    first = drafter.num_nodes
    parents = [root_id if acc.parents[n] < 0 else acc.ws[acc.parents[n]] for n in nodes]
    out = drafter.extend(parents, [acc.tokens[n] for n in nodes])  # [len(nodes), V]
    for j, n in enumerate(nodes):
        acc.ws[n] = first + j
    return [(n, out[j]) for j, n in enumerate(nodes)]


def _alternatives(
    logits: np.ndarray,
    a: int,
    sampling: Sampling | None,
    coupling: Coupling | None = None,
    position: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The draft's `a` most likely next tokens and their probabilities: from the q row that
    stochastic modes draw from (`sampling`), else softmax at temperature 1 (with `coupling`, the
    coupled token at absolute `position` first)."""
    if sampling is not None:
        q = sampling.q_row(logits)
        order = np.argsort(-q.weights, kind="stable")[:a]
        return q.ids[order], q.weights[order] / 65536.0
    ids, vals = _ranked(logits, a, coupling, position)
    return ids, np.exp(vals)


def _coupling(mode: Mode, coupling: Coupling | None) -> Coupling | None:
    """Coupling applies to sample-and-match only (greedy has no randomness; mss/rrs sample q)."""
    return coupling if mode is Mode.MATCH else None


def _check_stop(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise DraftCancelled("drafting stopped: the tree is no longer wanted")


def finish_leaves(
    drafter: Drafter,
    dr: DraftResult,
    *,
    mode: Mode | str = Mode.GREEDY,
    sampling: Sampling | None = None,
    coupling: Coupling | None = None,
    nodes: Sequence[int] | None = None,
) -> DraftResult:
    """Evaluate the nodes of `dr` left unevaluated (its leaves) in one drafter call and return the
    result with their workspace ids and alternatives filled in, as if drafted with eval_leaves.

    nodes: only these of the unevaluated nodes (default: all of them); the others stay
    unevaluated (workspace id -1, no alternatives), and a later call can still add them.

    The drafter's workspace must still hold the tree (no sync since it was drafted). The tree
    itself (tokens, draws) is unchanged; only what the draft believes after the leaves is added.
    Raises WorkspaceFullError when the leaves do not fit.
    """
    (out,) = finish_leaves_many(drafter, [(dr, nodes)], mode=mode, sampling=sampling, coupling=coupling)
    return out


def finish_leaves_many(
    drafter: Drafter,
    work: Sequence[tuple[DraftResult, Sequence[int] | None]],
    *,
    mode: Mode | str = Mode.GREEDY,
    sampling: Sampling | None = None,
    coupling: Coupling | None = None,
) -> list[DraftResult]:
    """`finish_leaves` for several trees of the workspace at once: all their leaves in ONE drafter
    call (a llama.cpp evaluation costs about the same for one token or a few)."""
    m = _mode(mode)
    if m.stochastic and sampling is None:
        raise ValueError(f"mode {m.value} samples: pass sampling=Sampling(...)")
    coupling = _coupling(m, coupling)
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
            ids, probs = _alternatives(out[row], a, sampling if m.stochastic else None, coupling, at)
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


def _check_room(drafter: Drafter, config: ExpansionConfig, eval_leaves: bool, fresh: bool) -> None:
    """Refuse a tree the workspace cannot hold. fresh: the tree starts from a sync, which empties
    the workspace first; otherwise it is drafted into the workspace as it is."""
    levels = np.cumprod(config.ks)
    evaluated = levels if eval_leaves else levels[:-1]
    nodes = int(evaluated.sum())
    leaves = int(evaluated[-1]) if evaluated.size else 0
    in_use, used_leaves = (0, 0) if fresh else (drafter.num_nodes, drafter.num_leaves)
    if in_use + nodes > drafter.max_nodes or used_leaves + leaves > drafter.max_leaves:
        raise WorkspaceFullError(
            f"tree {config} evaluates {nodes} nodes on {leaves} branches; the drafter holds "
            f"{drafter.max_nodes} nodes / {drafter.max_leaves} branches ({drafter.num_nodes} / "
            f"{drafter.num_leaves} in use): pick a narrower tree or a larger max_nodes / max_leaves"
        )


# ---------------------------------------------------------------------------------- dynamic
def draft_dynamic(
    drafter: Drafter,
    committed: Sequence[int],
    budget: int,
    *,
    max_depth: int = 16,
    width: int = 16,
    branch: int = 4,
    mode: Mode | str = Mode.GREEDY,
    cond: Sequence[int] = (),
    reuse_workspace: bool = False,
    eval_leaves: bool = False,
    alternatives: int = DEFAULT_ALTERNATIVES,
    stop: Callable[[], bool] | None = None,
    coupling: Coupling | None = None,
) -> DraftResult:
    """Best-first tree of `budget` nodes by draft path probability (deterministic modes only).

    A heap holds candidate children (the `branch` most likely tokens after every evaluated node),
    keyed by path log-probability. Sequential best-first would pop one candidate, evaluate it,
    push its children, and repeat: one drafter call per node. Here each round pops a BATCH and
    evaluates it in one call: the best candidate, then each next one while it would still win
    against the children of the batch's nodes, estimated as (best path prob in the batch) * m,
    m = the mean top-1 draft probability seen so far in this tree. A confident draft (m near 1)
    thus grows deep chains a level per call; an unsure one grows wide levels. At most `width`
    nodes per call; nodes at `max_depth` are not expanded. The final batch (filling the budget)
    is not evaluated unless `eval_leaves`. `stop` and `coupling` as in draft_static; a coupled
    token is ranked as if it were the most likely one (the target samples it with probability
    about the draft's agreement rate, whatever its draft probability).

    Stochastic modes are refused: whether a node is expanded would depend on other nodes' draws,
    and MSS/RRS need draw counts fixed independently of drawing; use a static shape for them.
    """
    t0 = time.perf_counter()
    m = _mode(mode)
    if m.stochastic:
        raise ValueError(f"dynamic trees are for greedy/match; mode {m.value} needs a static shape")
    if budget < 1 or width < 1 or branch < 1 or max_depth < 1:
        raise ValueError("budget, width, branch and max_depth must be positive")
    if (drafter.num_nodes if reuse_workspace else 0) + budget > drafter.max_nodes:
        raise WorkspaceFullError(
            f"a budget of {budget} nodes does not fit the drafter's workspace ({drafter.max_nodes} nodes, "
            f"{drafter.num_nodes} in use); lower the budget or raise max_nodes"
        )
    coupling = _coupling(m, coupling)
    at = len(committed) + len(cond)  # absolute position of the token after row 0
    evals = drafter.stats.extend_calls
    root_id, root_logits = _anchor(drafter, committed, cond, reuse_workspace)
    acc = _Acc(alternatives)
    heap: list[tuple[float, int, int, int, float]] = []  # (-path logp, order, parent, token, logp)
    top1: list[float] = []
    depth: list[int] = []
    rank: list[float] = []  # per node: the path log-probability it was ranked by
    order = itertools.count()  # FIFO among equal path probabilities

    def push_children(node: int, logits: np.ndarray) -> None:
        d = 0 if node < 0 else depth[node]
        ids, vals = _ranked(logits, max(branch, alternatives), coupling, at + d)
        acc.set_alt(node + 1, ids, np.exp(vals))
        best = float(vals.max())
        top1.append(math.exp(best))
        base = rank[node] if node >= 0 else 0.0
        for i, (tok, lp) in enumerate(zip(ids[:branch].tolist(), vals[:branch].tolist(), strict=True)):
            rank_lp = best if coupling is not None and i == 0 else lp
            heapq.heappush(heap, (-(base + rank_lp), next(order), node, tok, lp))

    push_children(-1, root_logits)
    while heap and len(acc.tokens) < budget:
        log_m = math.log(max(sum(top1) / len(top1), 1e-9))
        room = budget - len(acc.tokens)
        leaves_room = drafter.max_leaves - drafter.num_leaves
        batch: list[int] = []
        bar = -math.inf
        while heap and len(batch) < min(width, room) and -heap[0][0] >= bar:
            neg, _, parent, tok, lp = heapq.heappop(heap)
            node = acc.add(parent, tok, lp)
            depth.append(1 if parent < 0 else depth[parent] + 1)
            rank.append(-neg)
            batch.append(node)
            if len(batch) == 1:
                bar = -neg + log_m  # a child of the best batch node would reach about this
        full = len(acc.tokens) >= budget
        expand = [n for n in batch if eval_leaves or (not full and depth[n] < max_depth)]
        if len(expand) > leaves_room:  # cannot branch further: stop growing, keep the tree as is
            break
        _check_stop(stop)
        for node, logits in _evaluate(drafter, acc, expand, root_id):
            if depth[node] < max_depth:
                push_children(node, logits)
            else:
                ids, vals = _ranked(logits, alternatives, coupling, at + depth[node])
                acc.set_alt(node + 1, ids, np.exp(vals))
    frontier = np.sort(np.exp(np.asarray([-h[0] for h in heap], dtype=np.float64)))[::-1][:64]
    evals = drafter.stats.extend_calls - evals
    return acc.result(committed, cond, root_id, False, frontier, t0, evals)
