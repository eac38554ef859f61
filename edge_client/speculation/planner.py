"""The outcome planner: which conditional trees to draft next, most likely first, and the cost gate.

Every sent tree close enough to the committed sequence (PrespecConfig.max_chain) has its likely
outcomes (speculation.outcomes.predict_outcomes) queued as candidates, each with the odds that the
tree is verified times the odds of the outcome. The gate (outcomes.worth_drafting) drafts the top
candidate only while its expected saving outweighs the expected delay to a miss's fallback.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from edge_client.speculation.config import PrespecConfig
from edge_client.speculation.estimates import ChoiceModel, RoundEstimates
from edge_client.speculation.ledger import Ledger, extends
from edge_client.speculation.outcomes import Outcome, predict_outcomes, worth_drafting


@dataclass(frozen=True)
class Candidate:
    """A conditional tree to draft: below `full`, assuming an outcome of tree `parent`."""

    parent: int
    full: tuple[int, ...]
    prob: float
    entry: tuple[float, int, int, Outcome] | None = None  # its place in the heap (Planner.restore)


class Planner:
    """Candidate outcomes of the sent trees in a heap, most likely first."""

    def __init__(self, ledger: Ledger, cfg: PrespecConfig | None, choice: ChoiceModel) -> None:
        self.ledger = ledger
        self.cfg = cfg
        self.choice = choice
        self.heap: list[tuple[float, int, int, Outcome]] = []  # (-prob, order, parent round, outcome)
        self._order = itertools.count()

    def clear(self) -> None:
        self.heap.clear()

    def keep_known(self) -> None:
        """Drop the candidates of trees the ledger forgot."""
        self.heap = [h for h in self.heap if h[2] in self.ledger]
        heapq.heapify(self.heap)

    def expand_all(self) -> None:
        """Queue the outcomes of every sent tree close enough to the committed sequence."""
        if self.cfg is not None:
            for rid in self.ledger.to_expand(self.cfg.max_chain):
                self.expand(rid)

    def expand(self, rid: int) -> None:
        """Queue the likely outcomes of tree `rid` as candidates for conditional trees."""
        cfg = self.cfg
        if cfg is None:
            return
        spec = self.ledger.expanding(rid)
        if spec is None:
            return
        fanout = max(cfg.fanout, cfg.outcomes) if cfg.cache else cfg.fanout
        for o in predict_outcomes(spec.draft, fanout, cfg.r, cfg.allocation, self.choice):
            heapq.heappush(self.heap, (-spec.prob * o.prob, next(self._order), rid, o))

    def pop(
        self,
        limit: int,
        committed: tuple[int, ...],
        room: int,
        max_depth: int,
        min_prob: float | None = None,
    ) -> list[Candidate]:
        """Up to `limit` candidates, most likely first: the top one, then others at least
        `min_prob` (default cfg.batch_min_prob) likely while the server has `room` for them."""
        cfg = self.cfg
        assert cfg is not None
        floor = cfg.batch_min_prob if min_prob is None else min_prob
        max_cond = max_depth + 1
        out: list[Candidate] = []
        while self.heap and len(out) < max(1, min(limit, room)):
            neg_p, _, parent, outcome = self.heap[0]
            if out and -neg_p < floor:
                break
            entry = heapq.heappop(self.heap)
            spec = self.ledger.get(parent)
            if spec is None:
                continue
            full = spec.full + outcome.cond
            if not extends(full, committed) or len(full) - len(committed) > 4 * max_cond:
                continue
            out.append(Candidate(parent, full, spec.prob * outcome.prob, entry))
        return out

    def restore(self, candidates: list[Candidate]) -> None:
        """Put popped candidates back (a schedule had no time for them)."""
        for c in candidates:
            if c.entry is not None:
                heapq.heappush(self.heap, c.entry)

    def top(self) -> tuple[float, int] | None:
        """The most likely candidate's odds and parent round, if any."""
        if not self.heap:
            return None
        neg_p, _, parent, _ = self.heap[0]
        return -neg_p, parent

    def worth_next(self, in_flight: int, est: RoundEstimates, rtt_ms: float, now: float) -> bool:
        """The cost gate (outcomes.worth_drafting) for the most likely candidate, at clock time `now`."""
        cfg = self.cfg
        assert cfg is not None
        if est.draft_ms is None:
            return True
        neg_p, _, parent, _ = self.heap[0]
        live = self.ledger.get(in_flight)
        base = live.prob if live is not None and live.prob > 0 else 1.0
        p_hit = min(1.0, -neg_p / base)
        # the outcomes of the tree in flight that already have a conditional tree at the server
        cover = sum(s.prob for s in self.ledger.children_of(in_flight)) / base
        if parent == in_flight:
            cover += p_hit
        p_fallback = min(1.0, max(0.0, 1.0 - cover))
        due = est.verdict_due
        left = 0.0 if due is None else (due - now) * 1e3
        return worth_drafting(p_hit, p_fallback, est.draft_ms, rtt_ms, left, est.step_ms, cfg.min_gain)
