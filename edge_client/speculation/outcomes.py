"""Pre-speculation: hide the round trip by drafting for the likely outcomes of the round in flight.

Speculative Speculative Decoding (Saguaro, arXiv 2603.03251): while a verification is in flight,
predict its outcome (how many tree tokens are accepted, and the bonus token that follows) and
prepare the next speculation for the likely outcomes. Here each prepared speculation is a
*conditional tree* (docs/architecture.md §3.2): it assumes the committed sequence will be `S + cond`, where
cond = the accepted path's tokens + the bonus. The verifier keeps it and starts it right after
the verdict that makes it match, with no round trip; the others come back `stale`.

Outcome model. With the draft's probabilities standing in for the target's, the accepted path ends
at node j (j = -1: nothing accepted) with probability path_prob(j) * (1 - sum of j's children's
node_prob), and the bonus is b (not a child of j) with probability q(b | j) / (1 - sum of
children). So P(j, b) = path_prob(j) * q(b | j): the draft's own probability of the sequence
"path to j, then b". Pre-speculation fans out over those outcomes.

Fan-out (Saguaro's geometric rule): the miss rate of guessing F bonus tokens falls as a power law
F^-r, so minimising the expected miss sum_k P(k) (F_k)^-r under a total budget sum_k F_k = B gives
F_k proportional to P(k)^(1/(1+r)), where P(k) is the probability that exactly k tokens are
accepted; with a per-depth acceptance rate a, P(k) ~ a^k (1 - a) and the fan-out decays
geometrically with k, capped by the guesses available at that depth. Within depth k the F_k most
likely (node, bonus) pairs are taken.

Cost gate (worth_drafting). The edge drafts on one thread, so a speculative draft still running
when a verdict arrives delays the synchronous draft a miss needs. The speculation core abandons a
conditional draft between evaluations once a verdict rules its outcome out, so that delay is at
most one drafter evaluation. Each candidate is drafted only while its expected saving (a hit takes
the drafting and the round trip off the critical path) outweighs its expected cost (a miss waits
for what is left of the draft, at most one evaluation). Where hits are rare and the round trip
short (sampling at RTT 0) it holds the least likely candidates back; where the round trip is long
the drafts end before the verdict comes and cost no latency; a floor on the expected saving per
drafting ms (`min_gain`, 0 by default) holds back trees that would rarely be used where the edge's
energy matters more than the last few ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_client.drafters.base import Drafter
from edge_client.speculation.estimates import ChoiceModel
from edge_client.trees import DraftResult
from shared.tree import TokenTree


@dataclass(frozen=True)
class Outcome:
    """A predicted verdict of a tree: the accepted path ends at `node` and the bonus is `bonus`.

    cond: the tokens this outcome appends to the committed sequence (path tokens, then the bonus)
    """

    node: int
    bonus: int
    prob: float
    depth: int
    cond: tuple[int, ...]


def reach_probabilities(dr: DraftResult, model: ChoiceModel | None = None) -> np.ndarray:
    """[N] probability that each node is accepted (its whole path is), under `model`."""
    return _walk(dr, model or ChoiceModel(temperature=1.0))[0][1:]


def outcome_probabilities(
    dr: DraftResult, model: ChoiceModel | None = None
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Every (node, bonus) candidate with its probability P(path to j accepted, then bonus b).

    Returns (nodes [C], bonus tokens [C], probs [C]); node -1 is row 0 (nothing accepted). The
    target's choice at each row follows `model` (ChoiceModel); only the A alternatives the builder
    recorded after each row are candidates, and a bonus equal to a drafted child of j is not an
    outcome at j (that child would have been accepted).
    """
    _, nodes, toks, probs = _walk(dr, model or ChoiceModel(temperature=1.0))
    return nodes, np.asarray(toks, dtype=np.int64), np.asarray(probs, dtype=np.float64)


def _walk(dr: DraftResult, model: ChoiceModel) -> tuple[np.ndarray, list[int], list[int], list[float]]:
    """Reach probability of every row [N + 1] and every (node, bonus, prob) outcome candidate."""
    tree = dr.tree
    at_t = tree.is_stochastic
    reach = np.zeros(tree.num_nodes + 1)
    reach[0] = 1.0
    nodes: list[int] = []
    toks: list[int] = []
    probs: list[float] = []
    for row in range(tree.num_nodes + 1):
        j = row - 1
        if reach[row] <= 0:
            continue
        pi = model.choice(dr.alt_tokens[row], dr.alt_probs[row], at_t)
        kids = tree.children_of(j)
        kid_tokens = {int(tree.tokens[c]) for c in kids}
        for c in kids:
            p = pi.get(int(tree.tokens[c]), float(dr.node_prob[c]) * (1.0 - model.alpha))
            reach[c + 1] = max(reach[c + 1], reach[row] * p)
        for b, p in pi.items():
            if b in kid_tokens or p <= 0:
                continue
            nodes.append(j)
            toks.append(b)
            probs.append(float(reach[row] * p))
    return reach, nodes, toks, probs


def geometric_fanout(
    depth_probs: Sequence[float] | np.ndarray,
    available: Sequence[int] | np.ndarray,
    budget: int,
    r: float = 1.0,
) -> list[int]:
    """Saguaro's capped geometric allocation: F_k ∝ P(k)^(1/(1+r)), F_k <= available[k], sum <= budget.

    Integer counts by largest remainder; capacity a capped depth cannot use goes to the others.
    """
    p = np.maximum(np.asarray(depth_probs, dtype=np.float64), 0.0)
    cap = np.asarray(available, dtype=np.int64)
    out = np.zeros(p.size, dtype=np.int64)
    budget = min(budget, int(cap.sum()))
    while budget > int(out.sum()):
        open_ = (out < cap) & (p > 0)
        if not open_.any():
            break
        w = np.where(open_, p ** (1.0 / (1.0 + r)), 0.0)
        left = budget - int(out.sum())
        share = w / w.sum() * left
        add = np.minimum(np.floor(share).astype(np.int64), cap - out)
        if add.sum() == 0:
            # hand single units to the largest remainders
            order = np.argsort(-(share - np.floor(share)) - w * 1e-12)
            for k in order[:left]:
                if out[k] < cap[k] and open_[k]:
                    out[k] += 1
            continue
        out += add
    return out.tolist()


def predict_outcomes(
    dr: DraftResult,
    budget: int,
    r: float = 1.0,
    allocation: str = "geometric",
    model: ChoiceModel | None = None,
) -> list[Outcome]:
    """The `budget` outcomes to pre-speculate for, most likely first.

    allocation "geometric": Saguaro's fan-out across accepted lengths (module docstring);
    "top": simply the most likely (node, bonus) pairs; "uniform": the same number F of outcomes at
    every accepted length (its F most likely), F = budget / the lengths there are (at least 1), the
    likeliest kept when that exceeds the budget (SSD's top-F per position).
    """
    if budget <= 0:
        return []
    nodes, toks, probs = outcome_probabilities(dr, model)
    if probs.size == 0:
        return []
    tree = dr.tree
    depth = np.asarray([0 if j < 0 else int(tree.depth[j]) for j in nodes], dtype=np.int64)
    order = np.argsort(-probs, kind="stable")
    if allocation == "top":
        chosen = order[:budget]
    elif allocation == "uniform":
        lengths = sorted({int(k) for k in depth})
        per = max(1, budget // len(lengths))
        picked = [int(i) for k in lengths for i in [j for j in order if depth[j] == k][:per]]
        chosen = np.asarray(sorted(picked, key=lambda i: -probs[i])[:budget], dtype=np.int64)
    elif allocation == "geometric":
        kmax = int(depth.max())
        depth_p = np.zeros(kmax + 1)
        avail = np.zeros(kmax + 1, dtype=np.int64)
        for k in range(kmax + 1):
            at = depth == k
            avail[k] = int(at.sum())
            # P(exactly k accepted) ~ sum over nodes at depth k of path_prob * (1 - sum children)
            depth_p[k] = float(probs[at].sum())
        fan = geometric_fanout(depth_p, avail, budget, r)
        chosen_l: list[int] = []
        for k, f in enumerate(fan):
            at = [int(i) for i in order if depth[i] == k][:f]
            chosen_l.extend(at)
        chosen = np.asarray(sorted(chosen_l, key=lambda i: -probs[i]), dtype=np.int64)
    else:
        raise ValueError(f"allocation must be 'geometric', 'top' or 'uniform', got {allocation!r}")
    out = []
    for i in chosen.tolist():
        j = nodes[i]
        path = tree.path_tokens(j) if j >= 0 else []
        out.append(Outcome(j, int(toks[i]), float(probs[i]), int(depth[i]), (*path, int(toks[i]))))
    return out


def worth_drafting(
    p_hit: float,
    p_fallback: float,
    draft_ms: float,
    rtt_ms: float,
    time_left_ms: float,
    step_ms: float | None = None,
    min_gain: float = 0.0,
) -> bool:
    """The cost gate: is drafting one more conditional tree now expected to save time?

    The edge drafts on one thread, so a speculative draft still running when the verdict in flight
    arrives delays the synchronous fallback draft that a miss needs. Drafting pays off when

        p_hit * (rtt_ms + draft_ms)  >=  p_fallback * min(max(0, draft_ms - time_left_ms), step_ms)
                                          + min_gain * draft_ms

    gain: with probability p_hit the tree is verified with no round trip and no drafting on the
    critical path (both are what a synchronous round would have cost); loss: with probability
    p_fallback the next verdict matches no conditional tree, and the fallback waits for whatever
    of this draft is left when the verdict arrives (time_left_ms from now), or, where drafting is
    abandoned between evaluations once a verdict rules the tree out, for at most one evaluation.

    p_hit:        probability that this tree is verified (given the tree in flight is)
    p_fallback:   probability that the next verdict needs a synchronous draft, with this tree sent
    draft_ms:     expected drafting time of one tree
    rtt_ms:       expected round trip
    time_left_ms: expected time until the verdict in flight arrives
    step_ms:      one drafter evaluation, where drafting can be abandoned between them (None: it
                  cannot, the fallback waits for the whole rest of the draft)
    min_gain:     expected critical-path ms a conditional draft must save per ms of drafting, even
                  when it ends before the verdict: drafting is not free on the edge (energy, and
                  memory bandwidth shared with whatever else runs there), so a tree that will
                  rarely be used is not drafted
    """
    for name, v in (("p_hit", p_hit), ("p_fallback", p_fallback)):
        if not 0.0 <= v <= 1.0 + 1e-9:
            raise ValueError(f"{name} must be a probability, got {v}")
    gain = p_hit * (max(rtt_ms, 0.0) + max(draft_ms, 0.0))
    wait = max(0.0, draft_ms - max(time_left_ms, 0.0))
    if step_ms is not None:
        wait = min(wait, max(step_ms, 0.0))
    return gain >= p_fallback * wait + max(min_gain, 0.0) * max(draft_ms, 0.0)


def replay(drafter: Drafter, tree: TokenTree, root: int = -1) -> list[int]:
    """Put an already-drafted tree back into the drafter's workspace below `root`, level by level
    (one batched evaluation per level), so that outcomes below its nodes can be drafted.

    Returns the workspace id of every tree node. Reuses nodes the workspace already has.
    """
    ids = [-1] * tree.num_nodes
    depth = tree.depth
    for d in range(1, tree.max_depth + 1):
        par: list[int] = []
        tok: list[int] = []
        at: list[int] = []
        for i in np.flatnonzero(depth == d).tolist():
            p = int(tree.parents[i])
            wp = root if p < 0 else ids[p]
            found = drafter.find_child(wp, int(tree.tokens[i]))
            if found is not None:
                ids[i] = found
                continue
            par.append(wp)
            tok.append(int(tree.tokens[i]))
            at.append(i)
        if tok:
            first = drafter.num_nodes
            drafter.extend(par, tok)
            for k, i in enumerate(at):
                ids[i] = first + k
    return ids
