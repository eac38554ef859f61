"""Pre-speculation, the part of the speculation core that works while a round is in flight: the
gate that says whether to draft another conditional tree now (`_can_prespeculate`), drafting the
likeliest outcomes' trees and sending them (`_prespeculate_one`), the outcome cache that plans
chains to end before the verdict is due (`_cache_schedule`, `_plan_cache`), the miss path's
priced backups, and evaluating the leaves of trees already sent (`_finish_leaves`).

`PrespecSteps` is a base of `speculation.core.SpeculationCore`, which owns the state these steps
read and write (declared below for the type checker) and the helpers they call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator

from edge_client.speculation.actions import Ask, DraftConditional, Drafted, FinishLeaves, Steps, ask
from edge_client.speculation.backup import Backup, choose_backup
from edge_client.speculation.config import DrafterProfile, PrespecConfig, Request, TreeSpec
from edge_client.speculation.estimates import ChoiceModel, Learned, RoundEstimates
from edge_client.speculation.ledger import Ledger, extends
from edge_client.speculation.planner import Candidate, Planner
from edge_client.speculation.schedule import chain_gains, plan_chains
from edge_client.stats import GenerationStats
from edge_client.trees import DraftResult
from shared.messages import Mode, Welcome
from shared.protocol import ClientProtocol, ClientState
from shared.tree import ExpansionConfig


class PrespecSteps:
    """The pre-speculation steps of `SpeculationCore` (see the module docstring)."""

    # the core's state these steps use (SpeculationCore.__init__ sets every one)
    proto: ClientProtocol
    welcome: Welcome
    req: Request
    prespec: PrespecConfig | None
    learned: Learned
    stats: GenerationStats
    drafter: DrafterProfile | None
    clock: Callable[[], float]
    choice: ChoiceModel
    ledger: Ledger
    planner: Planner
    est: RoundEstimates
    anchor: tuple[int, ...]
    workspace_full: bool
    cancelled: bool
    _bytes_since_verdict: int
    _full: tuple[float, int, float] | None
    _cache_first: int | None
    _cache_idle: int | None
    _cache_planned_ms: float

    # the core's helpers these steps call
    @property
    def in_flight(self) -> int | None:
        raise NotImplementedError

    def _budget(self, rtt: bool = False) -> int:
        raise NotImplementedError

    def _room(self) -> int:
        raise NotImplementedError

    def _ruled_out(self, full: tuple[int, ...]) -> bool:
        raise NotImplementedError

    def _note_full(self, dr: DraftResult, plain: bool = True) -> None:
        raise NotImplementedError

    def _curve(self) -> dict[int, float]:
        raise NotImplementedError

    def _send_tree(
        self, dr: DraftResult, full: tuple[int, ...], prob: float, parent: int | None
    ) -> Generator[Ask[object], object, int]:
        raise NotImplementedError

    def _can_prespeculate(self) -> bool:
        cfg = self.prespec
        if cfg is None or self.cancelled or self.in_flight is None or self.workspace_full:
            return False
        if not self.planner.heap or self._room() <= 0:
            return False
        if self._cache_idle == self.in_flight:
            return False  # the outcome cache has no time left before this round's verdict
        if self._bytes_since_verdict >= cfg.byte_budget:
            return False
        rtt = self.learned.rtt_ms
        planned = cfg.cache and self._cache_first == self.in_flight  # the cache's chains keep to its time
        if (
            cfg.gate
            and not planned
            and not self.planner.worth_next(self.in_flight, self.est, rtt, self.clock())
        ):
            self.stats.prespec_gated += 1
            return False
        return True

    def _finish_leaves(self) -> Steps:
        pending = self.ledger.leaves_pending()
        work = tuple((r, spec.draft, nodes) for r, nodes in pending.items() if (spec := self.ledger.get(r)))
        t0 = self.clock()
        results: dict[int, DraftResult | None] = dict.fromkeys(pending)
        if work:
            done = yield from ask(FinishLeaves(work))
            if done.workspace_full:
                self.workspace_full = True
            else:
                results.update((rid, dr) for (rid, _, _), dr in zip(work, done.results, strict=True))
        self.stats.prespec_ms += (self.clock() - t0) * 1e3
        self.ledger.leaves_evaluated(results)
        self.planner.expand_all()

    def _prespeculate_one(self) -> Steps:
        """Draft the most likely candidate outcome's conditional tree and send it, and the next
        likely ones with it, in lockstep (trees.lockstep: static, sequence and sampled shapes a
        level at a time, budget shapes a best-first round at a time). Budget shapes join the
        lockstep in greedy only: in match the coupled ranking of every node is dear, and on the
        real pair at T 0.7 the batch cost more drafting than it saved (312.8 against 274.4
        ms/token one at a time: the lockstep drafting table of docs/results.md)."""
        cfg = self.prespec
        assert cfg is not None
        lockstep = self.req.tree.kind != "budget" or self.req.mode is Mode.GREEDY
        committed = tuple(self.proto.committed)
        max_depth = self.welcome.limits.max_depth
        shapes: tuple[TreeSpec, ...] | None = None
        cache = self._cache_schedule() if cfg.cache and lockstep else None
        if cache is None:
            limit = cfg.batch if lockstep else 1
            batch = self.planner.pop(limit, committed, self._room(), max_depth)
        elif cache == "first":
            # the likeliest outcome first and alone, with the configured shape
            batch = self.planner.pop(1, committed, self._room(), max_depth)
            self._cache_first = self.in_flight
        else:
            batch, shapes = self._plan_cache(committed, float(cache))
        if not batch:
            return
        for c in batch:
            self.ledger.attempt(c.parent, c.prob)
        t0 = self.clock()
        drafted: tuple[DraftResult | None, ...]
        if self.workspace_full:
            drafted = (None,) * len(batch)
        else:
            action = DraftConditional(
                self.anchor,
                tuple(c.full for c in batch),
                tuple(functools.partial(self._ruled_out, c.full) for c in batch),
                lockstep=len(batch) > 1 or shapes is not None,
                budget=self._budget(),
                shapes=shapes,
            )
            out: Drafted = yield from ask(action)
            if out.workspace_full:
                self.workspace_full = True
            self.stats.prespec_cancelled += out.cancelled
            drafted = out.results
        took = (self.clock() - t0) * 1e3
        self.stats.prespec_ms += took
        if shapes is not None:
            self.learned.observe_cache_plan(self._cache_planned_ms, took)
        for c, dr in zip(batch, drafted, strict=True):
            if dr is None:
                continue
            self.est.note_draft(dr)
            if shapes is None:
                self._note_full(dr, plain=False)
            now = tuple(self.proto.committed)
            if self.proto.state is not ClientState.GENERATING:
                return  # the generation ended (its last verdict is waiting in the queue)
            if self.cancelled or not (extends(c.full, now) or c.full == now):
                continue  # a verdict arrived while drafting and ruled this outcome out
            # (the batch was popped within _room(); frames decoded meanwhile only free room)
            yield from self._send_tree(dr, c.full, c.prob, c.parent)
            self.stats.prespec_sent += 1

    def _cache_schedule(self) -> str | float | None:
        """The outcome cache's next step: "first" (the likeliest outcome of the tree in flight,
        alone, full shape), the ms left to draft chains in, or None (no cache: batch as before;
        the drafter's costs are not measured yet).

        The chains must reach the server before it sends the verdict, not the edge before the
        verdict arrives: a chain sent later waits to be verified (a stall) while the drafter was
        busy. The verdict leaves the server half a round trip before it is due here and a chain
        needs half a round trip to get there, so the time to draft in ends one round trip before
        the verdict is due, shortened by the overrun measured on earlier plans."""
        if self._eval_curve() is None or self._full is None:
            return None
        top = self.planner.top()
        if top is not None and top[1] == self.in_flight and self._cache_first != self.in_flight:
            return "first"
        due = self.est.verdict_due
        now = self.clock()
        left = (due - now) * 1e3 if due is not None else self.est.verify_ms + self.learned.rtt_ms
        return max(0.0, (left - self.learned.rtt_ms) / self.learned.cache_overrun)

    def _plan_cache(
        self, committed: tuple[int, ...], left_ms: float
    ) -> tuple[list[Candidate], tuple[TreeSpec, ...] | None]:
        """Chains for the next likeliest outcomes, their depths planned to end before the verdict
        is due (speculation.schedule.plan_chains); nothing when no chain fits (then the core
        waits for the next frame)."""
        cfg, eval_ms = self.prespec, self._eval_curve()
        assert cfg is not None and eval_ms is not None
        cands = self.planner.pop(cfg.outcomes, committed, self._room(), self.welcome.limits.max_depth, 0.0)
        if not cands:
            return [], None
        best, _ = self._price_backups(eval_ms)
        miss = best.round_ms / max(best.tokens, 1e-9)  # what a token costs after a miss
        depth = min(self.req.tree.chain_depth, self.welcome.limits.max_depth)
        gains = chain_gains(self.choice.alpha, depth, miss, self._curve())
        plan = plan_chains([c.prob for c in cands], gains, eval_ms, left_ms)
        self._cache_planned_ms = plan.ms
        chosen = [(c, d) for c, d in zip(cands, plan.depths, strict=True) if d > 0]
        self.planner.restore([c for c, d in zip(cands, plan.depths, strict=True) if d == 0])
        if not chosen:
            self._cache_idle = self.in_flight
            return [], None
        shapes = tuple(TreeSpec("sequence", ExpansionConfig((1,) * d), depth=d) for _, d in chosen)
        return [c for c, _ in chosen], shapes

    def _eval_curve(self) -> Callable[[int], float] | None:
        """The drafter's ms for one evaluation of n rows (n times the one-row cost where n was
        never measured); None before it measured any."""
        prof = self.drafter
        one = None if prof is None else prof.eval_ms(1)
        if prof is None or one is None:
            return None

        def eval_ms(rows: int) -> float:
            ms = prof.eval_ms(rows)
            return one * rows if ms is None else ms

        return eval_ms

    def _price_backups(self, eval_ms: Callable[[int], float]) -> tuple[Backup, list[Backup]]:
        """The miss path's candidates priced (speculation.backup.choose_backup): the best, and all."""
        assert self._full is not None
        tokens, nodes, full_ms = self._full
        return choose_backup(
            self.req.tree,
            tokens,
            nodes,
            self.choice.alpha,
            eval_ms,
            self._curve(),
            self.learned.rtt_ms,
            self.welcome.limits.max_depth,
            full_draft_ms=full_ms,
        )
