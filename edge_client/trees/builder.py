"""The tree builder: a tree under construction, its options, what a drafted tree carries, and the
static shapes drafted with it (`draft_static`, `draft_sequence`: the default round's tree).

Every shape (the static ones below, trees.dynamic, trees.lockstep) grows a `TreeBuilder` level by
level, evaluating each level in one drafter call, and returns a `DraftResult`: the TokenTree plus the
draft's own probabilities of each node and of the best alternatives after each node, which
outcome prediction needs (edge_client.speculation.outcomes).

Conditional trees (pre-speculation): `DraftOptions.cond` tokens are assumed after the committed
sequence. With `reuse_workspace` the drafter's workspace is kept (e.g. the tree still in flight)
and the tree is drafted below the workspace node that `cond` leads to, extending it where needed.

Two things keep pre-speculation off the critical path: a conditional tree whose assumed outcome
a verdict has ruled out is abandoned between evaluations (`DraftOptions.stop`, DraftCancelled),
and a tree sent without its leaves evaluated gets them later (`trees.lockstep.finish_leaves`), so
the synchronous draft after a miss is no longer than a plain one.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from edge_client.drafters.base import Drafter, WorkspaceFullError
from edge_client.trees.sampling import (
    Coupling,
    Landing,
    LandingRow,
    Sampling,
    coupling_for,
    draft_mode,
    ranked_alts,
    top_alternatives,
)
from shared.messages import Mode
from shared.sparse import SparseDist, SparseRows
from shared.tree import Draws, ExpansionConfig, TokenTree

DEFAULT_ALTERNATIVES = 4


class DraftCancelled(Exception):
    """Drafting was abandoned because `stop()` said so (the tree is no longer wanted)."""


@dataclass(frozen=True)
class DraftOptions:
    """How to draft one tree (every shape takes these; the shape's own sizes are separate).

    mode:            greedy / match rank the draft's tokens; mss / rrs sample (need sampling, rng)
    sampling:        the q-row transform stochastic modes draw from (with Saguaro sampling, if any)
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
                    temperature 1 (deterministic modes) or its weight / 2^16 in the node's q row
                    (stochastic modes; before Saguaro scaling: the row drawn from is in tree.draws)
    path_prob:      [N] float32, product of node_prob along the root-to-node path; its sum is the
                    draft's estimate of the expected accepted length
    workspace_ids:  [N] int32, the drafter workspace node of each tree node; -1 for nodes never
                    evaluated (the last level, unless eval_leaves)
    root_id:        the workspace node the tree hangs below (-1: the committed end)
    alt_tokens:     [N + 1, A] int32, the draft's A most likely next tokens after row 0 (index 0)
                    and after node i (index i + 1), most likely first; -1 where not evaluated.
                    Coupled (match at T > 0): the coupled token, then the likeliest other
                    targets by the landing model (trees.sampling.Coupling.rank)
    alt_probs:      [N + 1, A] float32, their probabilities (same distribution as node_prob);
                    coupled: q_T of the coupled token, then the draft's mass outside it times
                    the landing model's P(target = x | not the coupled token) (`Ranking.probs`)
    frontier_probs: [F] float32, descending path probabilities of the best candidates left out
                    (dynamic trees; sizes the next budget, see edge_client.speculation.estimates)
    draft_ms:       wall time of drafting, sync included
    evaluations:    batched drafter evaluations made (extend calls)
    landing_rows:   coupled rows (index as alt_tokens) whose candidates' CDF intervals were
                    recorded, to learn the landing model's sigma from verdicts
    landing:        the learner the coupled rows were ranked with (Coupling.landing), or None
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
    landing_rows: Mapping[int, LandingRow] = field(default_factory=dict)
    landing: Landing | None = None

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
        self.landing_rows: dict[int, LandingRow] = {}
        self.landing: Landing | None = None  # set by shapes that record landing rows

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

    def set_alt(
        self, row: int, ids: np.ndarray, probs: np.ndarray, landing: LandingRow | None = None
    ) -> None:
        """Alternatives after row `row` (0: row 0, i + 1: node i), with a coupled row's landing
        candidates (Coupling.rank)."""
        n = min(self.a, ids.size)
        self.alt_tok[row][:n] = ids[:n]
        self.alt_p[row][:n] = probs[:n]
        if landing is not None:
            self.landing_rows[row] = landing

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
            landing_rows=dict(self.landing_rows),
            landing=self.landing if self.landing_rows else None,
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


class HostClock:
    """Times a builder's own work on a level (ranking the rows' logits, coupling, bookkeeping): the
    wall time from `start` to `stop` less the drafter's forward time in between, per row ranked,
    into DrafterStats.observe_host, so that planned evaluations are priced as they really run."""

    def __init__(self, drafter: Drafter) -> None:
        self.stats = drafter.stats
        self.t = 0.0
        self.forward = 0.0

    def start(self) -> None:
        self.t, self.forward = time.perf_counter(), self.stats.extend_ms

    def stop(self, rows: int) -> None:
        wall = (time.perf_counter() - self.t) * 1e3
        self.stats.observe_host(rows, wall - (self.stats.extend_ms - self.forward))


def check_stop(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise DraftCancelled("drafting stopped: the tree is no longer wanted")


# ---------------------------------------------------------------------------------------------------
# Static shapes: SpecInfer's expansion ⟨k1..km⟩ and the plain chain ⟨1,...,1⟩.
#
#
# Drafted level by level, so each drafter evaluation (one llama_decode) covers a whole level.
# Deterministic modes take the draft's top-k_i tokens at each node (distinct siblings).
# Stochastic modes (mss, rrs) take exactly k_i draws from the node's quantized q row (with
# replacement for mss; without, by Gumbel-top-k, for rrs; with Saguaro sampling from the row with
# the pre-speculated candidates scaled, trees.sampling.Saguaro) and the rows travel with the tree. The
# number of draws at a node is fixed before drawing and no draw is dropped; duplicate mss draws
# share one node and stay separate draws (docs/architecture.md §3.3).

_DEFAULT = DraftOptions()


def draft_static(
    drafter: Drafter,
    committed: Sequence[int],
    config: ExpansionConfig = ExpansionConfig(),
    opts: DraftOptions = _DEFAULT,
) -> DraftResult:
    """SpecInfer's expansion-based tree ⟨k1..km⟩, one drafter evaluation per level.

    Deterministic modes: node order is ExpansionConfig.parents() (level by level, siblings by
    rank), so the tree has exactly config.num_nodes nodes. Stochastic modes: each node at depth
    i-1 makes exactly k_i draws (rrs: min(k_i, row length), known before drawing); identical mss
    draws share a node, so the tree may have fewer nodes than config.num_nodes, never fewer draws.
    The last level is not evaluated unless `opts.eval_leaves` (pre-speculation wants its
    alternatives; `finish_leaves` can add them after the tree is sent). `opts.stop` and
    `opts.coupling`: see DraftOptions.
    """
    t0 = time.perf_counter()
    sampling, rng, cond, alternatives = opts.sampling, opts.rng, opts.cond, opts.alternatives
    eval_leaves = opts.eval_leaves
    m = draft_mode(opts.mode)
    stochastic = m.stochastic
    coupling = coupling_for(m, opts.coupling)
    at = len(committed) + len(cond)  # absolute position of the token after row 0
    if stochastic:
        if sampling is None or rng is None:
            raise ValueError(f"mode {m.value} samples: pass sampling=Sampling(...) and rng")
    _check_room(drafter, config, eval_leaves, fresh=not opts.reuse_workspace)
    evals = drafter.stats.extend_calls
    root_id, root_logits = anchor_node(drafter, committed, cond, opts.reuse_workspace)
    acc = TreeBuilder(alternatives)
    acc.landing = None if coupling is None else coupling.landing
    frontier: list[tuple[int, np.ndarray]] = [(-1, root_logits)]  # (tree node, logits after it)
    clock = HostClock(drafter)
    for level, k in enumerate(config.ks):
        clock.start()
        ranked = len(frontier)
        new: list[int] = []
        for node, logits in frontier:
            if stochastic:
                assert sampling is not None and rng is not None
                new.extend(sample_children(acc, node, logits, k, m, sampling, rng))
            else:
                ids, vals, probs, row = ranked_alts(logits, max(k, alternatives), coupling, at + level)
                acc.set_alt(node + 1, ids, probs, row)
                for tok, lp in zip(ids[:k].tolist(), vals[:k].tolist(), strict=True):
                    new.append(acc.add(node, tok, lp))
        last = level == config.depth - 1
        if last and not eval_leaves:
            break
        check_stop(opts.stop)
        frontier = evaluate_level(drafter, acc, new, root_id)
        clock.stop(ranked)
    if eval_leaves:  # alternatives after the leaves
        for node, logits in frontier:
            if stochastic:
                acc.set_alt(node + 1, *top_alternatives(logits, alternatives, sampling))
            else:
                ids, _, probs, row = ranked_alts(logits, alternatives, coupling, at + config.depth)
                acc.set_alt(node + 1, ids, probs, row)
    evals = drafter.stats.extend_calls - evals
    return acc.result(committed, cond, root_id, stochastic, np.zeros(0), t0, evals)


def draft_sequence(
    drafter: Drafter, committed: Sequence[int], depth: int, opts: DraftOptions = _DEFAULT
) -> DraftResult:
    """A chain as deep as the tree: ⟨1,...,1⟩ of `depth` levels (options as draft_static)."""
    return draft_static(drafter, committed, ExpansionConfig((1,) * depth), opts)


def sample_children(
    acc: TreeBuilder,
    node: int,
    logits: np.ndarray,
    k: int,
    mode: Mode,
    sampling: Sampling,
    rng: np.random.Generator,
) -> list[int]:
    """Exactly k draws (rrs: min(k, row length)) at `node` from its quantized q row; new nodes.

    The draws come from the row shipped with the tree (`Sampling.shipped_row`: q, or with Saguaro
    sampling q with its candidates scaled), so the verifier tests them against the row they were
    drawn from. The alternatives and each node's probability are the draft's own q: what the
    outcome model takes for the target's distribution."""
    q = sampling.q_row(logits)
    shipped = sampling.shipped_row(q, k)
    qrow = len(acc.q_rows)
    acc.q_rows.append(shipped)
    order = np.argsort(-q.weights, kind="stable")
    acc.set_alt(node + 1, q.ids[order], q.weights[order] / 65536.0)
    if mode is Mode.RRS:
        drawn = shipped.sample_without_replacement(rng, min(k, len(shipped)))
    else:
        drawn = shipped.sample(rng, k)
    new: list[int] = []
    for tok in drawn.tolist():
        child = acc.child.get((node, tok))
        if child is None:
            child = acc.add(node, tok, math.log(q.weight(tok) / 65536.0))
            new.append(child)
        acc.d_node.append(child)
        acc.d_qrow.append(qrow)
    return new


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
