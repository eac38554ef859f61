"""Several conditional trees drafted in lockstep: one drafter evaluation per level for all of them.

Pre-speculation drafts a tree for each likely outcome of the tree in flight (edge_client.speculation).
Drafted one after another, M trees of depth d cost M * d drafter evaluations; on a CPU a llama.cpp
evaluation is bound by reading the weights, so a batch of a few tokens costs little more than one
(Qwen2.5-Coder-0.5B Q4_K_M on one core: 75 ms for 1 token, 108 for 3, 122 for 4). Drafted in
lockstep, level i of every tree goes into one `Drafter.extend`, so M trees cost d evaluations of
M tokens each: the edge covers several outcomes in the time one used to take, and the verifier's
core shares the memory bus with fewer weight reads.

Deterministic modes (greedy, match): every tree takes the draft's top-k_i tokens at each node (with
coupling, the coupled token first), exactly as `trees.draft_static` does, so a tree drafted here
equals the one drafted alone below the same workspace node. Stochastic modes (mss, rrs): tree i
makes its draws with its own generator (`opts.rng.spawn(n)[i]`), node by node in the order
`draft_static` would, so it equals the tree drafted alone with that generator. Dynamic trees
(`draft_dynamic_many`): each tree grows best-first as `trees.draft_dynamic` grows it, and every
round's batches of all the trees go into one evaluation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from edge_client.drafters.base import Drafter, WorkspaceFullError
from edge_client.trees.builder import (
    DraftCancelled,
    DraftOptions,
    DraftResult,
    HostClock,
    TreeBuilder,
    sample_children,
)
from edge_client.trees.dynamic import BestFirst, Growth, check_growth
from edge_client.trees.sampling import (
    Coupling,
    Sampling,
    coupling_for,
    draft_mode,
    ranked_alts,
    top_alternatives,
)
from shared.messages import Mode
from shared.tree import ExpansionConfig

_DEFAULT = DraftOptions()


def draft_static_many(
    drafter: Drafter,
    committed: Sequence[int],
    config: ExpansionConfig | Sequence[ExpansionConfig],
    conds: Sequence[Sequence[int]],
    opts: DraftOptions = _DEFAULT,
    stops: Sequence[Callable[[], bool] | None] | None = None,
) -> list[DraftResult | None]:
    """Draft tree ⟨k1..km⟩ below `committed + cond` for every cond, in the current workspace;
    `config` is one shape for all, or one per cond (say chains of different depths: evaluation l
    then holds the level-l nodes of the trees deeper than l + 1).

    The drafter must be synced to exactly `committed` (as for reuse_workspace=True); each cond is
    followed down the workspace as far as it exists there and the rest is added as a chain (all
    those chains in one evaluation). Leaves are not evaluated (`trees.finish_leaves_many`). Of
    `opts` only mode, sampling, rng, coupling and alternatives apply (cond, stop: one per tree,
    here); stochastic modes draw tree i with `opts.rng.spawn(len(conds))[i]`.
    stops[i]: asked before every evaluation; when it says True, tree i is dropped (its entry is
    None) and the others go on; DraftCancelled when every tree is dropped. Raises
    WorkspaceFullError (nothing added) when the trees do not fit the workspace.
    """
    t0 = time.perf_counter()
    m = draft_mode(opts.mode)
    draws: _Sampled | None = None
    if m.stochastic:
        if opts.sampling is None or opts.rng is None:
            raise ValueError(f"mode {m.value} samples: pass sampling=Sampling(...) and rng")
        draws = _Sampled(m, opts.sampling, opts.rng.spawn(len(conds)))
    coupling = coupling_for(m, opts.coupling)
    configs, stop_of = _check_batch(drafter, committed, config, conds, stops)
    walks = _walk(drafter, conds)
    _check_room(drafter, walks, configs)
    evals0 = drafter.stats.extend_calls
    roots = _extend_conds(drafter, walks)
    at = [len(committed) + len(c) for c in conds]  # absolute position of the token after row 0
    batch = _Lockstep(configs, stop_of, roots, opts.alternatives, coupling, at, draws)
    clock = HostClock(drafter)
    for level in range(max(c.depth for c in configs)):
        clock.start()
        ranked = sum(
            len(f) for t, f in enumerate(batch.frontiers) if batch.alive[t] and level < configs[t].depth
        )
        new = batch.expand(level)
        growing = batch.growing(level)  # to evaluate
        if not any(growing):
            break
        batch.drop_unwanted(growing)
        if not any(growing):
            break
        batch.evaluate(drafter, new, growing)
        clock.stop(ranked)
    evals = drafter.stats.extend_calls - evals0
    return batch.results(committed, conds, t0, evals)


def draft_dynamic_many(
    drafter: Drafter,
    committed: Sequence[int],
    budget: int,
    conds: Sequence[Sequence[int]],
    opts: DraftOptions = _DEFAULT,
    stops: Sequence[Callable[[], bool] | None] | None = None,
    *,
    max_depth: int = 16,
    width: int = 16,
    branch: int = 4,
) -> list[DraftResult | None]:
    """A best-first tree of `budget` nodes (`trees.draft_dynamic`, same sizes) below `committed +
    cond` for every cond, in the current workspace: each tree pops its batches as it would alone,
    and the batches of all the trees in a round go into one drafter evaluation. Deterministic
    modes only. Workspace, conds, `opts` and `stops` as in `draft_static_many` (the trees share
    the workspace's free branches in order; a tree that finds none left stops growing there).
    """
    t0 = time.perf_counter()
    check_growth(opts.mode, budget, width, branch, max_depth)
    _check_synced(drafter, committed)
    stop_of = _stops_of(stops, len(conds))
    walks = _walk(drafter, conds)
    needed = sum(len(rest) for _, rest in walks) + budget * len(conds)
    if drafter.num_nodes + needed > drafter.max_nodes:
        raise WorkspaceFullError(
            f"{len(conds)} trees of {budget} nodes need {needed} nodes; the drafter holds "
            f"{drafter.max_nodes} ({drafter.num_nodes} in use): lower the budget or raise max_nodes"
        )
    coupling = coupling_for(draft_mode(opts.mode), opts.coupling)
    evals0 = drafter.stats.extend_calls
    roots = _extend_conds(drafter, walks)
    growth = Growth(budget, width, max_depth)
    grows = [BestFirst(opts.alternatives, branch, coupling, len(committed) + len(c), growth) for c in conds]
    for g, (_, logits) in zip(grows, roots, strict=True):
        g.push_children(-1, logits)
    alive, done = [True] * len(conds), [False] * len(conds)
    while True:
        levels = _next_levels(drafter, grows, alive, done)
        for t, stop in enumerate(stop_of):
            if levels[t] and stop is not None and stop():
                alive[t], levels[t] = False, []
        if not any(alive):
            raise DraftCancelled("drafting stopped: no tree of the batch is wanted any more")
        if not any(levels):
            break
        parents, tokens = [], []
        for t, nodes in enumerate(levels):
            acc = grows[t].acc
            parents += [roots[t][0] if acc.parents[n] < 0 else acc.ws[acc.parents[n]] for n in nodes]
            tokens += [acc.tokens[n] for n in nodes]
        first = drafter.num_nodes
        out = drafter.extend(parents, tokens)
        row = 0
        for t, nodes in enumerate(levels):
            for n in nodes:
                grows[t].acc.ws[n] = first + row
                grows[t].take(n, out[row])
                row += 1
    evals = drafter.stats.extend_calls - evals0
    return [
        g.acc.result(committed, c, root, False, g.frontier(), t0, evals) if alive[t] else None
        for t, (g, c, (root, _)) in enumerate(zip(grows, conds, roots, strict=True))
    ]


def _next_levels(
    drafter: Drafter, grows: list[BestFirst], alive: list[bool], done: list[bool]
) -> list[list[int]]:
    """The nodes each live tree evaluates next, as `draft_dynamic`'s loop pops them (a batch with
    none to evaluate is followed by the next); a tree out of candidates, budget or free branches
    is done."""
    room = drafter.max_leaves - drafter.num_leaves
    levels: list[list[int]] = [[] for _ in grows]
    for t, g in enumerate(grows):
        while alive[t] and not done[t] and not levels[t]:
            if not g.growing():
                done[t] = True
                break
            expand = g.next_level()
            if len(expand) > room:
                done[t] = True
                break
            levels[t] = expand
        room -= len(levels[t])
    return levels


def _check_synced(drafter: Drafter, committed: Sequence[int]) -> None:
    if drafter.committed_len != len(committed) or drafter.committed_tokens() != [int(t) for t in committed]:
        raise ValueError("lockstep drafting needs the drafter synced to exactly `committed`")


def _stops_of(stops: Sequence[Callable[[], bool] | None] | None, n: int) -> list[Callable[[], bool] | None]:
    stop_of: list[Callable[[], bool] | None] = list(stops) if stops is not None else [None] * n
    if len(stop_of) != n:
        raise ValueError("stops must have one entry per cond")
    return stop_of


def _check_batch(
    drafter: Drafter,
    committed: Sequence[int],
    config: ExpansionConfig | Sequence[ExpansionConfig],
    conds: Sequence[Sequence[int]],
    stops: Sequence[Callable[[], bool] | None] | None,
) -> tuple[list[ExpansionConfig], list[Callable[[], bool] | None]]:
    """The shape and the stop of every cond (ValueError: the drafter is not synced to exactly
    `committed`, or not one shape / stop per cond)."""
    _check_synced(drafter, committed)
    n = len(conds)
    configs = [config] * n if isinstance(config, ExpansionConfig) else list(config)
    if len(configs) != n:
        raise ValueError(f"{len(configs)} shapes for {n} conds: give one, or one per cond")
    return configs, _stops_of(stops, n)


def _walk(drafter: Drafter, conds: Sequence[Sequence[int]]) -> list[tuple[int, list[int]]]:
    """Where each cond leaves the workspace (its deepest node there), and what of it is still to be
    evaluated."""
    walks: list[tuple[int, list[int]]] = []
    for cond in conds:
        node, i = -1, 0
        while i < len(cond):
            child = drafter.find_child(node, int(cond[i]))
            if child is None:
                break
            node, i = child, i + 1
        walks.append((node, [int(t) for t in cond[i:]]))
    return walks


def _check_room(drafter: Drafter, walks: list[tuple[int, list[int]]], configs: list[ExpansionConfig]) -> None:
    """Refuse trees the workspace cannot hold, the conds' rest included (WorkspaceFullError)."""
    nodes_needed = sum(len(rest) for _, rest in walks)
    leaves_needed = 0
    for cfg in configs:
        levels = np.cumprod(cfg.ks)[:-1]  # evaluated levels (the last one is not)
        nodes_needed += int(levels.sum())
        leaves_needed += int(levels[-1]) if levels.size else 1
    if (
        drafter.num_nodes + nodes_needed > drafter.max_nodes
        or drafter.num_leaves + leaves_needed > drafter.max_leaves
    ):
        shapes = str(configs[0]) if len(set(configs)) == 1 else "of several shapes"
        raise WorkspaceFullError(
            f"{len(configs)} trees {shapes} need {nodes_needed} nodes on {leaves_needed} new branches; the "
            f"drafter holds {drafter.max_nodes} / {drafter.max_leaves} "
            f"({drafter.num_nodes} / {drafter.num_leaves} in use)"
        )


def _extend_conds(drafter: Drafter, walks: list[tuple[int, list[int]]]) -> list[tuple[int, np.ndarray]]:
    """The rest of every cond added as a chain, all in one evaluation; per cond, the workspace node
    its tree hangs below and the logits after it."""
    parents: list[int] = []
    tokens: list[int] = []
    ends: list[int] = []  # index in the batch of each chain's last token (-1: nothing to add)
    first = drafter.num_nodes
    for node, rest in walks:
        if not rest:
            ends.append(-1)
            continue
        for j, tok in enumerate(rest):
            parents.append(node if j == 0 else first + len(tokens) - 1)
            tokens.append(tok)
        ends.append(len(tokens) - 1)
    out = drafter.extend(parents, tokens) if tokens else None
    roots: list[tuple[int, np.ndarray]] = []
    for (node, _), end in zip(walks, ends, strict=True):
        if end < 0:
            roots.append((node, drafter.logits_at(node)))
        else:
            assert out is not None
            roots.append((first + end, out[end]))
    return roots


@dataclasses.dataclass(frozen=True)
class _Sampled:
    """How the trees of a stochastic batch draw: the mode, the q-row transform, a generator per tree."""

    mode: Mode
    sampling: Sampling
    rngs: list[np.random.Generator]


class _Lockstep:
    """The trees of one `draft_static_many` call, grown a level at a time: each tree's builder, the
    nodes of its last evaluated level with their logits (its frontier), and whether it is still
    wanted (alive)."""

    def __init__(
        self,
        configs: list[ExpansionConfig],
        stops: list[Callable[[], bool] | None],
        roots: list[tuple[int, np.ndarray]],
        alternatives: int,
        coupling: Coupling | None,
        at: list[int],
        draws: _Sampled | None = None,
    ) -> None:
        self.configs = configs
        self.draws = draws
        self.stops = stops
        self.roots = roots
        self.alternatives = alternatives
        self.coupling = coupling
        self.at = at
        self.n = len(configs)
        self.accs = [TreeBuilder(alternatives) for _ in configs]
        for acc in self.accs:
            acc.landing = None if coupling is None else coupling.landing
        self.alive = [True] * self.n
        self.frontiers: list[list[tuple[int, np.ndarray]]] = [[(-1, logits)] for _, logits in roots]

    def expand(self, level: int) -> list[list[int]]:
        """Every live tree's top-k_level children of its frontier (alternatives recorded); the new
        nodes, per tree."""
        new: list[list[int]] = [[] for _ in range(self.n)]
        for t in range(self.n):
            if not self.alive[t] or level >= self.configs[t].depth:
                continue
            k = self.configs[t].ks[level]
            acc = self.accs[t]
            for node, logits in self.frontiers[t]:
                if self.draws is not None:
                    d = self.draws
                    new[t].extend(sample_children(acc, node, logits, k, d.mode, d.sampling, d.rngs[t]))
                    continue
                ids, vals, probs, row = ranked_alts(
                    logits, max(k, self.alternatives), self.coupling, self.at[t] + level
                )
                acc.set_alt(node + 1, ids, probs, row)
                for tok, lp in zip(ids[:k].tolist(), vals[:k].tolist(), strict=True):
                    new[t].append(acc.add(node, tok, lp))
        return new

    def ranking(self, level: int) -> int:
        """The rows `expand(level)` ranks: the frontiers of the live trees that reach that level."""
        return sum(
            len(f) for t, f in enumerate(self.frontiers) if self.alive[t] and level < self.configs[t].depth
        )

    def growing(self, level: int) -> list[bool]:
        """Per tree: whether the level just expanded is to be evaluated (alive, not its last)."""
        return [self.alive[t] and level < self.configs[t].depth - 1 for t in range(self.n)]

    def drop_unwanted(self, growing: list[bool]) -> None:
        """Ask the stops of the live trees (in order): a tree whose stop says True is dropped, and
        stops growing; DraftCancelled when no tree is left."""
        for t in range(self.n):
            stop = self.stops[t]
            if self.alive[t] and stop is not None and stop():
                self.alive[t] = growing[t] = False
        if not any(self.alive):
            raise DraftCancelled("drafting stopped: no tree of the batch is wanted any more")

    def evaluate(self, drafter: Drafter, new: list[list[int]], growing: list[bool]) -> None:
        """The new nodes of the growing trees in one drafter evaluation; they become the frontiers."""
        parents: list[int] = []
        tokens: list[int] = []
        owner: list[tuple[int, int]] = []
        for t in range(self.n):
            if not growing[t]:
                continue
            acc, root_id = self.accs[t], self.roots[t][0]
            for nd in new[t]:
                p = acc.parents[nd]
                parents.append(root_id if p < 0 else acc.ws[p])
                tokens.append(acc.tokens[nd])
                owner.append((t, nd))
        first = drafter.num_nodes
        out = drafter.extend(parents, tokens)  # [len(tokens), V]
        self.frontiers = [[] for _ in range(self.n)]
        for j, (t, nd) in enumerate(owner):
            self.accs[t].ws[nd] = first + j
            self.frontiers[t].append((nd, out[j]))

    def results(
        self, committed: Sequence[int], conds: Sequence[Sequence[int]], t0: float, evals: int
    ) -> list[DraftResult | None]:
        """Every tree's DraftResult (None for a dropped tree)."""
        results: list[DraftResult | None] = []
        for t in range(self.n):
            if not self.alive[t]:
                results.append(None)
                continue
            acc, stochastic = self.accs[t], self.draws is not None
            root = self.roots[t][0]
            results.append(acc.result(committed, conds[t], root, stochastic, np.zeros(0), t0, evals))
        return results


# ---------------------------------------------------------------------------------------------------
# The leaves of trees already sent, evaluated later (pre-speculation's other batched evaluation)


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
        landing_rows = dict(dr.landing_rows)
        a = alt_tok.shape[1]
        for n in nodes:
            ws[n] = first + row
            at = tree.committed_len + int(tree.depth[n])  # absolute position of the token after node n
            if m.stochastic:
                ids, probs = top_alternatives(out[row], a, sampling)
            else:
                ids, _, probs, lrow = ranked_alts(out[row], a, coupling, at)
                if lrow is not None:
                    landing_rows[n + 1] = lrow
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
                landing_rows=landing_rows,
                landing=dr.landing if coupling is None else coupling.landing,
            )
        )
    return results
