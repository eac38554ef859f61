"""The rounds of one generation on the edge: draft, send, read verdicts, pre-speculate.

Without pre-speculation each round is synchronous: draft a tree below the committed sequence, send
it, wait for the verdict. With pre-speculation (SSD / Saguaro, see edge_client.prespec) the drafter
keeps working while a round is in flight: it drafts conditional trees for the most likely outcomes
of the tree in flight (and, going deeper, of those trees), most probable first, and sends each as
soon as it is drafted. After a verdict the next tree is then usually already at the verifier (the
verdict names it in `next_round`, or it is still on its way and will match on arrival); only on a
miss does the edge draft synchronously.

Bookkeeping. The drafter is synced to an *anchor* sequence; every tree is drafted in its workspace
below `anchor + cond` (reuse_workspace), so conditional trees reuse the nodes of the trees they
continue. A `Speculation` records a sent tree and the full committed sequence it assumes. On a
miss the drafter is re-synced to the committed sequence (the anchor moves). When the workspace
fills up during a run of hits, the anchor moves to the committed sequence and the tree in flight
is replayed into the fresh workspace.

Keeping the critical path short. Every tree is sent without its leaves evaluated; the leaves
(whose alternatives give the bonus tokens of the full-acceptance outcomes) are evaluated right
after, while the tree is in flight (trees.finish_leaves), and only those the outcome model gives
a fair chance of being reached (PrespecConfig.leaf_min_reach): on the edge's one drafting thread
each evaluated leaf costs about as much as a tree node. A conditional tree is abandoned between
drafter evaluations as soon as a verdict rules its assumed outcome out (trees.DraftCancelled), so
a miss's fallback draft waits for at most one evaluation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from edge_client.budget import AcceptanceCalibration, choose_budget, geometric_gains
from edge_client.drafters.base import Drafter, WorkspaceFullError
from edge_client.prespec import (
    ChoiceModel,
    Outcome,
    predict_outcomes,
    reach_probabilities,
    rebase,
    replay,
    worth_drafting,
)
from edge_client.stats import GenerationStats
from edge_client.trees import (
    Coupling,
    DraftCancelled,
    DraftOptions,
    DraftResult,
    Sampling,
    draft_dynamic,
    draft_sequence,
    draft_static,
    draft_static_many,
    finish_leaves_many,
)
from shared.errors import ErrorCode
from shared.messages import Error, Mode, Prompt, Stale, Tree, Verdict, Welcome
from shared.protocol import ClientState
from shared.tree import ExpansionConfig

if TYPE_CHECKING:
    from edge_client.client import EdgeClient


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the trees the edge drafts.

    static:   SpecInfer expansion <k1..km> (`expansion`)
    budget:   best-first tree of `budget` nodes (0: chosen each round from the server's cost curve)
    sequence: a chain of `depth` tokens (default: as deep as the static tree)
    """

    kind: Literal["static", "budget", "sequence"] = "static"
    expansion: ExpansionConfig = field(default_factory=ExpansionConfig)
    budget: int = 0
    depth: int = 0

    @property
    def chain_depth(self) -> int:
        return self.depth or self.expansion.depth


@dataclass(frozen=True)
class PrespecConfig:
    """How much to pre-speculate per round.

    fanout:      conditional trees drafted for the outcomes of one tree (Saguaro's geometric
                 allocation across accepted lengths, edge_client.prespec)
    max_chain:   how many rounds ahead a speculation may reach (2: also the outcomes of a
                 conditional tree, before the verdict that would start it)
    byte_budget: bytes of conditional trees sent between two verdicts
    allocation:  "geometric" (Saguaro) or "top" (simply the most likely outcomes)
    r:           power-law exponent of the miss rate in the geometric rule
    gate:        draft a conditional tree only when its expected saving (hit: no drafting and no
                 round trip on the critical path) outweighs its expected cost (miss: the fallback
                 draft waits on the edge's one drafting thread until the conditional draft is
                 abandoned, at most one evaluation); edge_client.prespec.worth_drafting
    min_gain:    with the gate, expected critical-path ms a conditional tree must save per ms spent
                 drafting it. 0 (latency first): draft whatever costs no expected latency; raise it
                 where edge energy matters, to hold back trees that would rarely be used
    batch:       conditional trees drafted together in lockstep (static and sequence shapes in
                 greedy / match: one drafter evaluation per level for all of them)
    batch_min_prob: a candidate joins the batch of a more likely one only when at least this likely
    leaf_min_reach: a sent tree's leaves (drafted but not evaluated) are evaluated after sending, to
                 predict the bonus token of the outcomes that accept them; only the leaves accepted
                 with at least this probability are (the side branches of a sampled tree, or every
                 leaf of a weak draft's, are almost never reached: evaluating them only occupies
                 the drafting thread, at about the cost of a tree node each)
    """

    fanout: int = 3
    max_chain: int = 3
    batch: int = 4
    batch_min_prob: float = 0.03
    byte_budget: int = 64 * 1024
    allocation: str = "geometric"
    r: float = 1.0
    gate: bool = True
    min_gain: float = 0.0
    leaf_min_reach: float = 0.02

    def __post_init__(self) -> None:
        checks = (
            ("fanout", self.fanout >= 1, "at least 1"),
            ("max_chain", self.max_chain >= 1, "at least 1"),
            ("batch", self.batch >= 1, "at least 1"),
            ("batch_min_prob", 0 <= self.batch_min_prob <= 1, "in [0, 1]"),
            ("byte_budget", self.byte_budget >= 0, "0 or more"),
            ("allocation", self.allocation in ("geometric", "top"), "'geometric' or 'top'"),
            ("r", self.r > 0, "positive"),
            ("min_gain", self.min_gain >= 0, "0 or more"),
            ("leaf_min_reach", 0 <= self.leaf_min_reach <= 1, "in [0, 1]"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"PrespecConfig.{name} must be {what}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Request:
    """What one generation asks for, as the round driver needs it."""

    mode: Mode
    tree: TreeSpec
    sampling: Sampling | None = None
    rng: np.random.Generator | None = None
    coupling: Coupling | None = None  # mode match at temperature > 0 (edge_client.trees.Coupling)


@dataclass
class Speculation:
    """A tree that was sent: its draft, the committed sequence it assumes, and its odds."""

    round: int
    draft: DraftResult
    full: tuple[int, ...]  # the committed sequence the tree assumes (its row 0 is full[-1])
    prob: float  # estimated probability that it gets verified
    parent: int | None  # the round whose outcome it assumes (None: drafted below the committed sequence)
    sent_at: float = 0.0


class RoundDriver:
    """Runs the rounds of one generation and yields its verdicts in order (see the module docstring)."""

    def __init__(
        self,
        client: EdgeClient,
        req: Request,
        prompt: Prompt,
        stats: GenerationStats,
        prespec: PrespecConfig | None,
    ) -> None:
        self.client = client
        self.req = req
        self.prompt = prompt
        self.stats = stats
        self.prespec = prespec if req.mode is not Mode.AR else None
        self.drafter: Drafter | None = client.drafter
        welcome = client.welcome
        assert welcome is not None
        self.welcome: Welcome = welcome
        self.cancelled = False
        self.specs: dict[int, Speculation] = {}
        self.anchor: tuple[int, ...] = ()
        self.heap: list[tuple[float, int, int, Outcome]] = []  # (-prob, order, parent round, outcome)
        self._order = itertools.count()
        self._bytes_since_verdict = 0
        self._workspace_full = False
        self._expanded: set[int] = set()
        self.calibration: AcceptanceCalibration = client.calibration
        self.choice: ChoiceModel = client.choice_model(
            prompt.temperature if req.mode is not Mode.GREEDY else 0.0, coupled=req.coupling is not None
        )
        self.in_flight: int | None = None
        # running estimates for the cost gate (PrespecConfig.gate)
        self._draft_est_ms: float | None = None
        self._verify_est_ms = 0.0
        self._verdict_due: float | None = None  # perf_counter time the verdict in flight is expected
        self._step_est_ms: float | None = None  # one drafter evaluation
        # sent trees whose leaves are still to be evaluated, and which of their leaves
        self._leaves_pending: dict[int, list[int]] = {}
        # per tree: the summed odds of the outcomes a conditional draft was started for (sent or
        # abandoned), for GenerationStats.predicted_hits
        self._attempted: dict[int, float] = {}

    # ------------------------------------------------------------------ drafting (drafter thread)
    async def _draft(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.client.pool, fn)

    def _shape(
        self,
        committed: Sequence[int],
        cond: Sequence[int],
        reuse: bool,
        leaves: bool,
        stop: Callable[[], bool] | None = None,
    ) -> DraftResult:
        assert self.drafter is not None
        spec, lim = self.req.tree, self.welcome.limits
        opts = DraftOptions(
            mode=self.req.mode,
            sampling=self.req.sampling,
            rng=self.req.rng,
            coupling=self.req.coupling,
            cond=tuple(cond),
            reuse_workspace=reuse,
            eval_leaves=leaves,
            stop=stop,
        )
        if spec.kind == "sequence":
            return draft_sequence(self.drafter, committed, min(spec.chain_depth, lim.max_depth), opts)
        if spec.kind == "budget":
            return draft_dynamic(self.drafter, committed, self._budget(), opts, max_depth=lim.max_depth)
        return draft_static(self.drafter, committed, spec.expansion, opts)

    def _budget(self) -> int:
        assert self.drafter is not None
        spec = self.req.tree
        cap = min(self.welcome.limits.max_nodes, self.drafter.max_nodes // 2)
        if spec.budget:
            return min(spec.budget, cap)
        last = self.client.last_draft
        alpha = self.choice.alpha if self.choice.temperature == 0 else 0.7
        if last is None:
            gains = geometric_gains(alpha, cap)
        else:
            # the last tree's nodes as the target accepts them (ChoiceModel), what its frontier
            # left out, and a deeper chain: a budget may grow past the last tree
            deeper = alpha ** np.arange(last.tree.max_depth + 1, last.tree.max_depth + 1 + cap)
            gains = np.concatenate([reach_probabilities(last, self.choice), last.frontier_probs, deeper])
        st = self.drafter.stats
        per_node = st.extend_ms / st.extend_nodes if st.extend_nodes else 0.0
        rtt = 0.0 if self.prespec is not None else self.client.rtt_estimate_ms
        return choose_budget(
            self.welcome.verify_cost_ms,
            gains,
            rtt_ms=rtt,
            draft_ms_per_node=per_node,
            max_nodes=cap,
        )

    def _plain(self, committed: tuple[int, ...]) -> DraftResult:
        """A tree below `committed`, drafter re-synced to it (the anchor moves). On the critical
        path: its leaves are left for `_finish_leaves`, after the tree is sent."""
        self.anchor = committed
        self._workspace_full = False
        self._leaves_pending.clear()  # the old workspace is gone
        return self._shape(committed, (), reuse=False, leaves=False)

    def _conditional(self, full: tuple[int, ...]) -> DraftResult | None:
        """A tree below `full` (which extends the anchor), in the current workspace; None if the
        workspace is full or a verdict ruled `full` out while drafting."""
        if self._workspace_full:
            return None
        try:
            return self._shape(
                self.anchor,
                full[len(self.anchor) :],
                reuse=True,
                leaves=False,
                stop=lambda: self._ruled_out(full),
            )
        except WorkspaceFullError:
            self._workspace_full = True
            return None
        except DraftCancelled:
            self.stats.prespec_cancelled += 1
            return None

    def _conditional_many(self, fulls: list[tuple[int, ...]]) -> list[DraftResult | None]:
        """Trees below several sequences that extend the anchor, drafted in lockstep; None for those
        a verdict ruled out while drafting (all None when the workspace is full)."""
        if self._workspace_full:
            return [None] * len(fulls)
        spec, lim = self.req.tree, self.welcome.limits
        config = spec.expansion
        if spec.kind == "sequence":
            config = ExpansionConfig((1,) * min(spec.chain_depth, lim.max_depth))
        assert self.drafter is not None
        try:
            out = draft_static_many(
                self.drafter,
                self.anchor,
                config,
                [f[len(self.anchor) :] for f in fulls],
                DraftOptions(mode=self.req.mode, coupling=self.req.coupling),
                stops=[functools.partial(self._ruled_out, f) for f in fulls],
            )
        except WorkspaceFullError:
            self._workspace_full = True
            return [None] * len(fulls)
        except DraftCancelled:
            self.stats.prespec_cancelled += len(fulls)
            return [None] * len(fulls)
        self.stats.prespec_cancelled += sum(d is None for d in out)
        return out

    def _refused_speculation(self, e: Error) -> bool:
        """A conditional tree the server had no room for (TOO_MANY_PENDING) is dropped like a stale
        one: the generation goes on. Any other error, or one about the tree in flight, fails it."""
        r = e.round
        if e.fatal or e.code is not ErrorCode.TOO_MANY_PENDING or r is None or r == self.in_flight:
            return False
        spec = self.specs.pop(r, None)
        if spec is None or spec.parent is None:
            return False
        self._leaves_pending.pop(r, None)
        self.stats.prespec_refused += 1
        return True

    def _ruled_out(self, full: tuple[int, ...]) -> bool:
        """The verdicts received so far (decoded by the pump, on the loop's thread) exclude `full`.
        Called from the drafting thread: a verdict half-applied only delays the answer."""
        proto = self.client.proto
        if self.cancelled or proto.state is not ClientState.GENERATING:
            return True
        committed = tuple(proto.committed)
        return not (full[: len(committed)] == committed)

    def _leaves(self, pending: dict[int, list[int]]) -> None:
        """Drafting thread: evaluate the given leaves of sent trees (still in the workspace), all
        in one drafter evaluation."""
        work = [(rid, nodes) for rid, nodes in pending.items() if rid in self.specs]
        if not work:
            return
        assert self.drafter is not None
        try:
            done = finish_leaves_many(
                self.drafter,
                [(self.specs[rid].draft, nodes) for rid, nodes in work],
                DraftOptions(mode=self.req.mode, sampling=self.req.sampling, coupling=self.req.coupling),
            )
        except WorkspaceFullError:
            self._workspace_full = True
            return
        for (rid, _), dr in zip(work, done, strict=True):
            spec = self.specs.get(rid)
            if spec is not None:
                self.specs[rid] = dataclasses.replace(spec, draft=dr)

    def _reanchor(self, spec: Speculation, committed: tuple[int, ...]) -> DraftResult:
        """Move the anchor to `committed` (= spec.full) and replay the tree in flight below it."""
        assert self.drafter is not None
        self.drafter.sync(committed)
        self.anchor = committed
        self._workspace_full = False
        self._leaves_pending.clear()
        replay(self.drafter, spec.draft.tree)
        return spec.draft

    # ------------------------------------------------------------------ the loop
    async def run(self) -> AsyncIterator[Verdict]:
        client, st = self.client, self.stats
        first: DraftResult | None = None
        prompt_full = tuple(client.proto.committed_for(self.prompt))
        if self.req.mode is not Mode.AR:
            first = await self._draft(functools.partial(self._plain, prompt_full))
            st.draft_ms.append(first.draft_ms)
            self._note_draft(first)
        prompt = self.prompt if first is None else dataclasses.replace(self.prompt, tree=first.tree)
        t_sent = time.perf_counter()
        await client.send(client.proto.prompt(prompt))
        if first is not None:
            self.specs[0] = Speculation(0, first, prompt_full, 1.0, None, t_sent)
            self._verdict_due = t_sent + (client.rtt_estimate_ms + self._verify_est_ms) / 1e3
            self._sent(0)
        self.in_flight = 0
        queue: asyncio.Queue[Any] = asyncio.Queue()
        pump = asyncio.create_task(self._pump(queue))
        try:
            while True:
                if self._leaves_pending and queue.empty():
                    await self._finish_leaves()
                    continue
                if self._can_prespeculate() and queue.empty():
                    await self._prespeculate_one()
                    continue
                msg, received = await queue.get()
                if isinstance(msg, BaseException):
                    raise msg
                if isinstance(msg, Error):
                    if self._refused_speculation(msg):
                        continue
                    raise client.refused(msg)
                if isinstance(msg, Stale):
                    self.specs.pop(msg.round, None)
                    self._attempted.pop(msg.round, None)
                    if msg.round != self.in_flight or client.proto.state is not ClientState.GENERATING:
                        continue
                    # the tree taken for current (one still on its way when the verdict came) was
                    # refused after all: nothing is in flight, draft below the committed sequence
                    self.in_flight = None
                elif isinstance(msg, Verdict):
                    reanchor = self._on_verdict(msg, received)
                    yield msg
                    if msg.done:
                        return
                    if reanchor is not None:
                        # a run of hits filled the workspace: move the anchor, replay the tree in flight
                        spec, committed_now = reanchor
                        await self._draft(functools.partial(self._reanchor, spec, committed_now))
                        self._expanded.discard(spec.round)
                        self._expand(spec.round)
                else:
                    continue
                if self.cancelled or self.req.mode is Mode.AR or self.in_flight is not None:
                    continue
                # a miss: draft synchronously below the committed sequence. The pump decodes ahead of
                # this loop, so later verdicts may already be queued (and the generation over).
                if client.proto.state is not ClientState.GENERATING:
                    continue
                committed = tuple(client.proto.committed)
                self.heap.clear()
                dr = await self._draft(functools.partial(self._plain, committed))
                st.draft_ms.append(dr.draft_ms)
                self._note_draft(dr)
                now = client.proto
                if now.state is not ClientState.GENERATING or tuple(now.committed) != committed:
                    # a verdict came in while drafting (the generation may even have ended): this
                    # tree is not current; the verdict waits in the queue and decides what follows
                    continue
                await self._send_tree(dr, committed, 1.0, None)
        finally:
            pump.cancel()

    async def _pump(self, queue: asyncio.Queue[Any]) -> None:
        while True:
            try:
                msg = await self.client.recv()
            except BaseException as exc:  # a broken connection reaches the loop as an exception
                await queue.put((exc, time.perf_counter()))
                return
            # stamped on arrival: the loop may be busy drafting when it comes, and the round trip
            # (stats, dynamic budgets, the cost gate) must not count that wait
            await queue.put((msg, time.perf_counter()))

    async def _send_tree(
        self, dr: DraftResult, full: tuple[int, ...], prob: float, parent: int | None
    ) -> int:
        client = self.client
        rid = client.next_round()
        wire = rebase(dr.tree, len(client.proto.committed))
        frame = client.proto.tree(Tree(round=rid, tree=wire))
        await client.send(frame)
        self._bytes_since_verdict += len(frame)
        self.specs[rid] = Speculation(rid, dr, full, prob, parent, time.perf_counter())
        client.last_draft = dr
        if self.in_flight is None and tuple(client.proto.committed) == full:
            self.in_flight = rid
            sent = self.specs[rid].sent_at
            self._verdict_due = sent + (client.rtt_estimate_ms + self._verify_est_ms) / 1e3
        self._sent(rid)
        return rid

    def _sent(self, rid: int) -> None:
        """Tree `rid` is on its way: queue its outcomes, or first those of its leaves that are likely
        enough to be reached to be worth evaluating (PrespecConfig.leaf_min_reach)."""
        cfg = self.prespec
        if cfg is None:
            return
        spec = self.specs[rid]
        missing = spec.draft.workspace_ids < 0
        if bool(missing.any()):
            reach = spec.prob * reach_probabilities(spec.draft, self.choice)
            wanted = np.flatnonzero(missing & (reach >= cfg.leaf_min_reach)).tolist()
            if wanted:
                self._leaves_pending[rid] = wanted
        self._expand_all()

    async def _finish_leaves(self) -> None:
        pending = dict(self._leaves_pending)
        t0 = time.perf_counter()
        await self._draft(functools.partial(self._leaves, pending))
        self.stats.prespec_ms += (time.perf_counter() - t0) * 1e3
        for rid in pending:
            self._leaves_pending.pop(rid, None)
        self._expand_all()

    # ------------------------------------------------------------------ pre-speculation
    def _ahead(self, spec: Speculation) -> int:
        """How many unverified trees stand between the committed sequence and this one."""
        n = 0
        while spec.parent is not None and spec.parent in self.specs:
            spec = self.specs[spec.parent]
            n += 1
        return n

    def _expand_all(self) -> None:
        """Queue the outcomes of every sent tree close enough to the committed sequence."""
        cfg = self.prespec
        if cfg is None:
            return
        for rid, spec in list(self.specs.items()):
            if rid in self._leaves_pending:
                continue
            if rid not in self._expanded and self._ahead(spec) < cfg.max_chain:
                self._expand(rid)

    def _expand(self, rid: int) -> None:
        """Queue the likely outcomes of tree `rid` as candidates for conditional trees."""
        cfg = self.prespec
        spec = self.specs.get(rid)
        if cfg is None or spec is None or rid in self._expanded:
            return
        self._expanded.add(rid)
        for o in predict_outcomes(spec.draft, cfg.fanout, cfg.r, cfg.allocation, self.choice):
            p = spec.prob * o.prob
            heapq.heappush(self.heap, (-p, next(self._order), rid, o))

    def _can_prespeculate(self) -> bool:
        cfg = self.prespec
        if cfg is None or self.cancelled or self.in_flight is None or not self.heap or self._workspace_full:
            return False
        proto = self.client.proto
        # the server keeps max_pending trees besides the one it verifies; with none in flight (after
        # a miss, chained trees may wait for the fallback) every outstanding tree may be pending
        room = self.welcome.limits.max_pending + (1 if proto.in_flight is not None else 0)
        if len(proto.outstanding) >= room:
            return False
        if self._bytes_since_verdict >= cfg.byte_budget:
            return False
        if cfg.gate and not self._worth_next(cfg):
            self.stats.prespec_gated += 1
            return False
        return True

    def _note_draft(self, dr: DraftResult) -> None:
        self._draft_est_ms = _ema(self._draft_est_ms, dr.draft_ms)
        if dr.evaluations > 0:
            self._step_est_ms = _ema(self._step_est_ms, dr.draft_ms / dr.evaluations)

    def _worth_next(self, cfg: PrespecConfig) -> bool:
        """The cost gate (edge_client.prespec.worth_drafting) for the most likely candidate."""
        if self._draft_est_ms is None or self.in_flight is None:
            return True
        neg_p, _, parent, _ = self.heap[0]
        live = self.specs.get(self.in_flight)
        base = live.prob if live is not None and live.prob > 0 else 1.0
        p_hit = min(1.0, -neg_p / base)
        # the outcomes of the tree in flight that already have a conditional tree at the server
        cover = sum(s.prob for s in self.specs.values() if s.parent == self.in_flight) / base
        if parent == self.in_flight:
            cover += p_hit
        p_fallback = min(1.0, max(0.0, 1.0 - cover))
        due = self._verdict_due
        left = 0.0 if due is None else (due - time.perf_counter()) * 1e3
        return worth_drafting(
            p_hit,
            p_fallback,
            self._draft_est_ms,
            self.client.rtt_estimate_ms,
            left,
            self._step_est_ms,
            cfg.min_gain,
        )

    async def _prespeculate_one(self) -> None:
        """Draft the most likely candidate outcome's conditional tree and send it; with a static or
        sequence shape in a deterministic mode, also the next likely ones, in lockstep (one
        drafter evaluation per level for all of them, edge_client.trees.lockstep)."""
        cfg = self.prespec
        assert cfg is not None
        batch = self._pop_candidates(cfg.batch if self._lockstep_ok() else 1, cfg)
        if not batch:
            return
        for parent, _, prob in batch:
            self._attempted[parent] = self._attempted.get(parent, 0.0) + prob
        t0 = time.perf_counter()
        if len(batch) == 1:
            one = await self._draft(functools.partial(self._conditional, batch[0][1]))
            drafted: list[DraftResult | None] = [one]
        else:
            drafted = await self._draft(functools.partial(self._conditional_many, [b[1] for b in batch]))
        self.stats.prespec_ms += (time.perf_counter() - t0) * 1e3
        for (parent, full, prob), dr in zip(batch, drafted, strict=True):
            if dr is None:
                continue
            self._note_draft(dr)
            now = tuple(self.client.proto.committed)
            if self.client.proto.state is not ClientState.GENERATING:
                return  # the generation ended (its last verdict is waiting in the queue)
            if self.cancelled or not (_extends(full, now) or full == now):
                continue  # a verdict arrived while drafting and ruled this outcome out
            await self._send_tree(dr, full, prob, parent)
            self.stats.prespec_sent += 1

    def _lockstep_ok(self) -> bool:
        return self.req.tree.kind in ("static", "sequence") and not self.req.mode.stochastic

    def _pop_candidates(self, limit: int, cfg: PrespecConfig) -> list[tuple[int, tuple[int, ...], float]]:
        """Up to `limit` candidates (parent round, assumed sequence, probability) from the heap, most
        likely first: the top one, then others at least cfg.batch_min_prob likely while the server
        has room for them."""
        committed = tuple(self.client.proto.committed)
        max_cond = self.welcome.limits.max_depth + 1
        proto = self.client.proto
        room = self.welcome.limits.max_pending + (1 if proto.in_flight is not None else 0)
        room -= len(proto.outstanding)
        out: list[tuple[int, tuple[int, ...], float]] = []
        while self.heap and len(out) < max(1, min(limit, room)):
            neg_p, _, parent, outcome = self.heap[0]
            if out and -neg_p < cfg.batch_min_prob:
                break
            heapq.heappop(self.heap)
            spec = self.specs.get(parent)
            if spec is None:
                continue
            full = spec.full + outcome.cond
            if not _extends(full, committed) or len(full) - len(committed) > 4 * max_cond:
                continue
            out.append((parent, full, spec.prob * outcome.prob))
        return out

    # ------------------------------------------------------------------ verdicts
    def _on_verdict(self, v: Verdict, now: float) -> tuple[Speculation, tuple[int, ...]] | None:
        """Account a verdict (received at perf_counter time `now`); find the tree now in flight;
        returns what to re-anchor on, if needed."""
        st, proto = self.stats, self.client.proto
        spec = self.specs.pop(v.round, None)
        # the odds the outcome model gave the outcomes of this tree that conditional drafts were
        # started for (counting those abandoned: a draft still running when the verdict comes is
        # finished and sent only if the verdict matches it)
        attempted = self._attempted.pop(v.round, 0.0)
        predicted = min(1.0, attempted / spec.prob) if spec is not None and spec.prob > 0 else 0.0
        st.rounds += 1
        st.tokens += len(v.tokens)
        st.verify_ms.append(v.verify_ms)
        self._verify_est_ms = _ema(self._verify_est_ms or None, v.verify_ms)
        if spec is not None:
            tree = spec.draft.tree
            st.tree_nodes.append(tree.num_nodes)
            acc = v.accepted_nodes.tolist()
            st.record_accepted([int(tree.depth[i]) for i in acc])
            self.calibration.update(spec.draft.expected_accepted, len(acc))
            if not tree.is_stochastic:
                self.choice.observe(spec.draft, acc, v.tokens.tolist())
            if spec.parent is None and self.in_flight == v.round:
                rtt = max(0.0, (now - spec.sent_at) * 1e3 - v.verify_ms)
                st.rtt_ms.append(rtt)
                self.client.observe_rtt(rtt)
        self._bytes_since_verdict = 0
        committed = tuple(proto.committed)
        nxt: int | None = v.next_round
        if nxt is None and not v.done:
            # a conditional tree still on its way to the server: it matches on arrival
            matching = [r for r, s in self.specs.items() if s.full == committed and r in proto.outstanding]
            nxt = max(matching) if matching else None
        self.in_flight = None if v.done else nxt
        # a conditional tree that matched is verified right away: its verdict follows in one verify
        self._verdict_due = None if nxt is None else now + self._verify_est_ms / 1e3
        if not v.done and not self.cancelled and self.req.mode is not Mode.AR:
            st.record_outcome(len(v.accepted_nodes), nxt is not None, predicted)
        # forget what can no longer happen
        self.specs = {
            r: s for r, s in self.specs.items() if _extends(s.full, committed) or s.full == committed
        }
        self.heap = [h for h in self.heap if h[2] in self.specs]
        heapq.heapify(self.heap)
        self._expand_all()
        if self.in_flight is not None and self._workspace_full and self.in_flight in self.specs:
            self.heap.clear()
            return self.specs[self.in_flight], committed
        return None

    def cancel(self) -> None:
        self.cancelled = True
        self.heap.clear()


def _ema(old: float | None, new: float) -> float:
    """Exponential average of the running estimates (the first sample starts it)."""
    return new if old is None else 0.7 * old + 0.3 * new


def _extends(full: tuple[int, ...], committed: tuple[int, ...]) -> bool:
    """full strictly extends committed (the tree is still to be verified)."""
    return len(full) > len(committed) and full[: len(committed)] == committed


__all__ = ["PrespecConfig", "Request", "RoundDriver", "Speculation", "TreeSpec"]
