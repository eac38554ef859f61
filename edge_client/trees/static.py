"""Static shapes: SpecInfer's expansion ⟨k1..km⟩ and the plain chain ⟨1,...,1⟩.

Drafted level by level, so each drafter evaluation (one llama_decode) covers a whole level.
Deterministic modes take the draft's top-k_i tokens at each node (distinct siblings).
Stochastic modes (mss, rrs) take exactly k_i draws from the node's quantized q row (with
replacement for mss; without, by Gumbel-top-k, for rrs) and the rows travel with the tree. The
number of draws at a node is fixed before drawing and no draw is dropped; duplicate mss draws
share one node and stay separate draws (DESIGN 3.1).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from edge_client.drafters.base import Drafter, WorkspaceFullError
from edge_client.trees.builder import (
    DraftOptions,
    DraftResult,
    TreeBuilder,
    anchor_node,
    check_stop,
    evaluate_level,
)
from edge_client.trees.sampling import Sampling, coupling_for, draft_mode, ranked, top_alternatives
from shared.messages import Mode
from shared.tree import ExpansionConfig

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
    frontier: list[tuple[int, np.ndarray]] = [(-1, root_logits)]  # (tree node, logits after it)
    for level, k in enumerate(config.ks):
        new: list[int] = []
        for node, logits in frontier:
            if stochastic:
                assert sampling is not None and rng is not None
                new.extend(_sample_children(acc, node, logits, k, m, sampling, rng))
            else:
                ids, vals = ranked(logits, max(k, alternatives), coupling, at + level)
                acc.set_alt(node + 1, ids, np.exp(vals))
                for tok, lp in zip(ids[:k].tolist(), vals[:k].tolist(), strict=True):
                    new.append(acc.add(node, tok, lp))
        last = level == config.depth - 1
        if last and not eval_leaves:
            break
        check_stop(opts.stop)
        frontier = evaluate_level(drafter, acc, new, root_id)
    if eval_leaves:  # alternatives after the leaves
        for node, logits in frontier:
            q = sampling if stochastic else None
            acc.set_alt(node + 1, *top_alternatives(logits, alternatives, q, coupling, at + config.depth))
    evals = drafter.stats.extend_calls - evals
    return acc.result(committed, cond, root_id, stochastic, np.zeros(0), t0, evals)


def draft_sequence(
    drafter: Drafter, committed: Sequence[int], depth: int, opts: DraftOptions = _DEFAULT
) -> DraftResult:
    """A chain as deep as the tree: ⟨1,...,1⟩ of `depth` levels (options as draft_static)."""
    return draft_static(drafter, committed, ExpansionConfig((1,) * depth), opts)


def _sample_children(
    acc: TreeBuilder,
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
