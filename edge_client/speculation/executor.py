"""The asyncio shell around the speculation core: the draft step it runs on the drafting thread,
the socket, and the frame pump.

It runs the core's actions (speculation.actions): draft actions on the client's one drafting
thread (`DraftStep`, with the edge's drafters), send actions through the client's protocol and
transport, and it decodes frames on a pump task, stamped on arrival, so that the core sees them in
order while the protocol (which the core's abandoned-draft checks read) is never behind the socket.

With several drafters (SpecInfer Definition 3.2) every tree, conditional ones included, is drafted
by each drafter, in turn or (with a `parallel` pool) at the same time, each with its own shape,
below the same sequence, and the trees are merged (trees.merged): the core sees one tree. Leaves
are evaluated and the tree in flight is replayed in the first drafter's workspace; the others
draft conditional trees below the anchor in theirs (a path they lack is evaluated on the way).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from edge_client.drafters.base import Drafter, DrafterStats, WorkspaceFullError
from edge_client.session import VerifierTimeout
from edge_client.speculation.actions import (
    DRAFT_ACTIONS,
    Ask,
    Deliver,
    Delivered,
    DraftAction,
    DraftConditional,
    Drafted,
    DraftPlain,
    FinishLeaves,
    Reanchor,
    Reanchored,
    Send,
    Sent,
    Steps,
)
from edge_client.speculation.config import Request, TreeSpec
from edge_client.speculation.core import SpeculationCore
from edge_client.speculation.outcomes import replay
from edge_client.stats import DraftEvent
from edge_client.trees import (
    DraftCancelled,
    DraftOptions,
    DraftResult,
    draft_dynamic,
    draft_dynamic_many,
    draft_sequence,
    draft_static,
    draft_static_many,
    finish_leaves_many,
)
from edge_client.trees.merged import merge_drafts
from shared.messages import Message, Prompt, SessionLimits, Verdict
from shared.protocol import ClientProtocol, ClientState
from shared.tree import ExpansionConfig

T = TypeVar("T")


class DraftStep:
    """Drafts what the core asks for (speculation.actions) with `drafters` under the server's limits.

    `shapes[i]` is drafter i's tree shape (default: `req.tree` for every drafter); the first
    drafter's is `req.tree`, the one the core sizes (a dynamic budget of 0 is chosen by the core
    for the first drafter only: the others need a fixed budget). `run(action)` is called on the
    one drafting thread (llama.cpp contexts are single-threaded); `max_nodes` and `ms_per_node`
    describe the first drafter to the core's dynamic budget.

    `parallel`: an executor with a thread for each drafter after the first: then the drafters draft
    a round's trees at the same time (each drafter still on one thread at a time), and a merged
    round costs the slowest drafter's time instead of the sum. Stochastic draws then come from a
    generator spawned per drafter from the request's (reproducible for a seed; not the same draws
    as in turn).

    `costs[i]`: what the client measured of drafter i's evaluations (speculation.estimates.Learned
    .drafter_costs; default: this step's own). Each drafter reports its evaluations there while
    `run` drafts, and `ms_per_node` / `eval_ms` read them there: a drafter shared by several
    clients carries no client's measurements into another's plans.
    """

    def __init__(
        self,
        drafters: Sequence[Drafter],
        req: Request,
        limits: SessionLimits,
        shapes: Sequence[TreeSpec] | None = None,
        parallel: concurrent.futures.Executor | None = None,
        costs: Sequence[DrafterStats] | None = None,
    ) -> None:
        if not drafters:
            raise ValueError("the draft step needs at least one drafter")
        self.costs = tuple(costs) if costs is not None else tuple(DrafterStats() for _ in drafters)
        if len(self.costs) != len(drafters):
            raise ValueError(
                f"{len(drafters)} drafters but {len(self.costs)} cost records: give one per drafter"
            )
        shapes = tuple(shapes) if shapes is not None else (req.tree,) * len(drafters)
        if len(shapes) != len(drafters):
            raise ValueError(f"{len(drafters)} drafters but {len(shapes)} tree shapes: give one per drafter")
        for i, sh in enumerate(shapes[1:], 1):
            if sh.kind == "budget" and sh.budget <= 0:
                raise ValueError(f"drafter {i}: a dynamic tree after the first drafter needs a budget > 0")
        self.drafters = tuple(drafters)
        self.shapes = (req.tree, *shapes[1:])
        self.req = req
        self.limits = limits
        self.options = DraftOptions(mode=req.mode, sampling=req.sampling, rng=req.rng, coupling=req.coupling)
        self.parallel = parallel if len(self.drafters) > 1 else None

    @property
    def drafter(self) -> Drafter:
        return self.drafters[0]

    @property
    def max_nodes(self) -> int:
        return self.drafter.max_nodes

    def ms_per_node(self) -> float:
        return self.costs[0].ms_per_node()

    def eval_ms(self, rows: int) -> float | None:
        """The drafters' ms for one evaluation of `rows` rows (merged: the slowest if in parallel,
        else their sum); None before every drafter measured one for this client."""
        each = [c.eval_ms(rows) for c in self.costs]
        known = [x for x in each if x is not None]
        if len(known) < len(each):
            return None
        return max(known) if self.parallel is not None else sum(known)

    def run(self, action: DraftAction) -> DraftResult | Drafted | Reanchored:
        """Draft what `action` asks, every drafter reporting its evaluations to `costs` meanwhile."""
        for d, c in zip(self.drafters, self.costs, strict=True):
            d.stats.mirror = c
        try:
            return self._run(action)
        finally:
            for d in self.drafters:
                d.stats.mirror = None

    def _run(self, action: DraftAction) -> DraftResult | Drafted | Reanchored:
        if isinstance(action, DraftPlain):
            return self._each(action.committed, self.options, action.budget, action.shape)
        if isinstance(action, DraftConditional):
            return self._conditional(action)
        if isinstance(action, FinishLeaves):
            return self._leaves(action)
        for d in self.drafters:
            d.sync(action.committed)
        replay(self.drafter, action.tree)
        return Reanchored()

    def _each(
        self, committed: Sequence[int], opts: DraftOptions, budget: int, shape: TreeSpec | None = None
    ) -> DraftResult:
        """Every drafter's tree below `committed` (+ opts.cond), merged; `shape` instead of each
        drafter's own."""
        drafts = self._all(lambda i, o: self._shape(i, committed, o, budget, shape), opts)
        return drafts[0] if len(drafts) == 1 else merge_drafts(drafts)  # one drafter: nothing to merge

    def _all(self, work: Callable[[int, DraftOptions], T], opts: DraftOptions) -> list[T]:
        """work(i, options) for every drafter i: in turn, or on the `parallel` pool (drafter 0 on
        this thread). Every drafter has finished before this returns or raises (the first
        drafter's error, in drafter order), so no drafter is still busy when the next step starts."""
        n = len(self.drafters)
        if self.parallel is None:
            return [work(i, opts) for i in range(n)]
        rngs = opts.rng.spawn(n) if opts.rng is not None else [None] * n
        each = [opts.replace(rng=r) for r in rngs]
        futures = [self.parallel.submit(work, i, each[i]) for i in range(1, n)]
        try:
            first = work(0, each[0])
        finally:
            concurrent.futures.wait(futures)
        return [first, *(f.result() for f in futures)]

    def _shape(
        self, i: int, committed: Sequence[int], opts: DraftOptions, budget: int, shape: TreeSpec | None = None
    ) -> DraftResult:
        drafter, spec, lim = self.drafters[i], shape or self.shapes[i], self.limits
        if spec.kind == "sequence":
            return draft_sequence(drafter, committed, min(spec.chain_depth, lim.max_depth), opts)
        if spec.kind == "budget":
            budget = self._budget_of(i, budget)
            return draft_dynamic(drafter, committed, budget, opts, max_depth=lim.max_depth)
        return draft_static(drafter, committed, spec.expansion, opts)

    def _budget_of(self, i: int, budget: int) -> int:
        """Drafter i's node budget: the core sizes the first drafter's; the others' are fixed."""
        if not i:
            return budget
        return min(self.shapes[i].budget, self.limits.max_nodes, self.drafters[i].max_nodes // 2)

    def _conditional(self, a: DraftConditional) -> Drafted:
        n = len(a.fulls)
        try:
            if not a.lockstep:
                (full,) = a.fulls
                opts = self.options.replace(cond=full[len(a.anchor) :], reuse_workspace=True, stop=a.stops[0])
                return Drafted((self._each(a.anchor, opts, a.budget),))
            per_drafter = self._all(lambda i, o: self._lockstep(i, a, o), self.options)
        except WorkspaceFullError:
            return Drafted((None,) * n, workspace_full=True)
        except DraftCancelled:
            return Drafted((None,) * n, cancelled=n)
        out: list[DraftResult | None] = []
        for j in range(n):
            drafts = [d for trees in per_drafter if (d := trees[j]) is not None]
            out.append(merge_drafts(drafts) if len(drafts) == len(per_drafter) else None)
        return Drafted(tuple(out), cancelled=sum(d is None for d in out))

    def _lockstep(self, i: int, a: DraftConditional, options: DraftOptions) -> list[DraftResult | None]:
        """Drafter i's trees below each of a.fulls, together: one evaluation per level (static,
        sequence and sampled shapes), or per round of best-first batches (a budget shape)."""
        spec = self.shapes[i]
        conds = [f[len(a.anchor) :] for f in a.fulls]
        if a.shapes is not None:
            configs = [
                sh.expansion
                if sh.kind == "static"
                else ExpansionConfig((1,) * min(sh.chain_depth, self.limits.max_depth))
                for sh in a.shapes
            ]
            return draft_static_many(self.drafters[i], a.anchor, configs, conds, options, stops=list(a.stops))
        if spec.kind == "budget":
            budget, drafter = self._budget_of(i, a.budget), self.drafters[i]
            return draft_dynamic_many(
                drafter, a.anchor, budget, conds, options, list(a.stops), max_depth=self.limits.max_depth
            )
        config = spec.expansion
        if spec.kind == "sequence":
            config = ExpansionConfig((1,) * min(spec.chain_depth, self.limits.max_depth))
        return draft_static_many(self.drafters[i], a.anchor, config, conds, options, stops=list(a.stops))

    def _leaves(self, a: FinishLeaves) -> Drafted:
        try:
            done = finish_leaves_many(self.drafter, [(dr, nodes) for _, dr, nodes in a.work], self.options)
        except WorkspaceFullError:
            return Drafted((None,) * len(a.work), workspace_full=True)
        return Drafted(tuple(done))


_DRAFT_KINDS: dict[type, str] = {
    DraftPlain: "plain",
    DraftConditional: "conditional",
    FinishLeaves: "leaves",
    Reanchor: "reanchor",
}


def _trees_asked(action: DraftAction) -> int:
    if isinstance(action, DraftConditional):
        return len(action.fulls)
    if isinstance(action, FinishLeaves):
        return len(action.work)
    return 1


class RoundExecutor:
    """Runs one generation's core and yields its verdicts in order.

    send:  sends one encoded frame (the client's transport; raises when the connection drops)
    recv:  receives one frame, decoded on arrival by the client's protocol (the pump; the core
           acknowledges each frame when it takes it up)
    pool:  the one drafting thread
    verdict_timeout_s: the longest silence of the verifier while the client waits for a verdict
           (the prompt's, the round in flight's, the end of a cancel); then VerifierTimeout

    The shell writes nothing of the round state: the core encodes every frame it sends through
    its protocol (`Send` carries the bytes) and keeps the ledger; the shell stamps times with the
    core's clock.
    """

    def __init__(
        self,
        core: SpeculationCore,
        step: DraftStep | None,
        send: Callable[[bytes], Awaitable[None]],
        recv: Callable[[], Awaitable[Message]],
        pool: concurrent.futures.Executor,
        verdict_timeout_s: float | None = None,
    ) -> None:
        self.core = core
        self.step = step
        self.proto: ClientProtocol = core.proto
        self._send = send
        self._recv = recv
        self.pool = pool
        self.verdict_timeout_s = verdict_timeout_s
        self._out: list[Verdict] = []
        # the frame pump's queue (while a generation runs), and frames taken from it during a draft
        # that wait for the core's loop, in order
        self._queue: asyncio.Queue[tuple[Message | BaseException, float]] | None = None
        self._held: collections.deque[tuple[Message | BaseException, float]] = collections.deque()
        if step is not None and core.stats.trace is not None:
            step.costs[0].log = []  # the trace's draft events carry each evaluation

    @property
    def cancelled(self) -> bool:
        return self.core.cancelled

    def cancel(self) -> None:
        self.core.cancel()

    async def _drive(self, steps: Steps) -> AsyncGenerator[Verdict, None]:
        """Drive one core step to its end, executing each action it yields; a verdict is yielded
        to the client the moment the core delivers it. While a draft runs, the verdicts of a
        stream that goes on are taken up as they come (`_take_streamed`): the target's tokens
        reach the user without waiting for the edge's drafting."""
        result: object = None
        while True:
            try:
                action = steps.send(result)
            except StopIteration:
                return
            if isinstance(action, DRAFT_ACTIONS) and self._queue is not None:
                running = asyncio.ensure_future(self._execute(action))
                while await self._take_streamed(running):
                    while self._out:
                        yield self._out.pop(0)
                result = running.result()
            else:
                result = await self._execute(action)
            while self._out:
                yield self._out.pop(0)

    async def _take_streamed(self, running: asyncio.Future[object]) -> bool:
        """Wait for the draft `running` or the next frame, whichever comes first; a frame that is a
        stream's verdict with more to come is taken up now (the core's `receive` only accounts it
        and delivers it: the round in flight stays the stream), any other waits in `_held` for the
        core's loop. True while the draft is still running and frames may be taken."""
        queue = self._queue
        if queue is None or self._held or running.done():
            if not running.done():
                await asyncio.wait({running})
            return False
        getter = asyncio.ensure_future(queue.get())
        either: set[asyncio.Future[Any]] = {running, getter}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            await asyncio.wait({getter})
            if getter.cancelled():
                return False
        msg, received = getter.result()
        if not (isinstance(msg, Verdict) and msg.streaming and not msg.done):
            self._held.append((msg, received))
            return not running.done()
        steps = self.core.receive(msg, received)
        result: object = None
        while True:
            try:
                action = steps.send(result)
            except StopIteration:
                break
            if not isinstance(action, Deliver):
                raise RuntimeError(f"a streamed verdict asked for {type(action).__name__}")
            result = await self._execute(action)
        return not running.done()

    async def _execute(self, action: Ask[object]) -> object:
        if isinstance(action, DRAFT_ACTIONS):
            assert self.step is not None
            loop = asyncio.get_running_loop()
            t0 = self.core.clock()
            result = await loop.run_in_executor(self.pool, self.step.run, action)
            trace = self.core.stats.trace
            if trace is not None:
                kind, trees = _DRAFT_KINDS[type(action)], _trees_asked(action)
                log = self.step.costs[0].take_log()
                trace.drafts.append(DraftEvent(t0, self.core.clock(), kind, trees, log))
            return result
        if isinstance(action, Send):
            await self._send(action.frame)
            return Sent(len(action.frame), self.core.clock())
        if isinstance(action, Deliver):
            self._out.append(action.verdict)
            return Delivered()
        raise TypeError(f"unknown action {action!r}")

    async def run(self, prompt: Prompt) -> AsyncGenerator[Verdict, None]:
        core = self.core
        steps: Steps | None = core.start(prompt)
        queue: asyncio.Queue[tuple[Message | BaseException, float]] = asyncio.Queue()
        pump: asyncio.Task[None] | None = None
        if core.streams:  # mode auto: a stream's tokens are taken up while the edge drafts
            self._queue = queue
        try:
            while steps is not None:
                async for v in self._drive(steps):
                    yield v
                if pump is None:  # the prompt is sent: its frames may come
                    pump = asyncio.create_task(self._pump(queue))
                if core.finished:
                    break
                steps = core.idle(quiet=queue.empty() and not self._held)
                if steps is None:
                    msg, received = self._held.popleft() if self._held else await queue.get()
                    if isinstance(msg, BaseException):
                        raise msg
                    steps = core.receive(msg, received)
        finally:
            # the pump must be gone before anyone else reads the connection (a cancel's drain, the
            # next generation): frames it decoded are in the protocol's state already
            if pump is not None:
                pump.cancel()
                await asyncio.wait([pump])

    def _awaiting_verdict(self) -> bool:
        """The client waits for the verifier: the prompt's verdict, the round in flight's, or the
        verdict that ends a cancelled generation (not while the edge drafts after a miss)."""
        p = self.proto
        if p.state is ClientState.CANCELLING:
            return True
        return p.state is ClientState.GENERATING and (p.awaiting_prompt or p.in_flight is not None)

    async def _pump(self, queue: asyncio.Queue[tuple[Message | BaseException, float]]) -> None:
        clock = self.core.clock
        while True:
            try:
                try:
                    # asyncio.timeout, not wait_for: under Python 3.11 wait_for returns a frame that
                    # arrives as the pump is cancelled and drops the cancel, and the pump would read on
                    # until the verifier closed the idle session (tests/edge_client/test_frame_pump.py)
                    async with asyncio.timeout(self.verdict_timeout_s):
                        msg = await self._recv()
                except TimeoutError:
                    if not self._awaiting_verdict():
                        continue
                    raise VerifierTimeout(
                        f"no verdict from the verifier within {self.verdict_timeout_s:g} s (the round in "
                        f"flight: {self.proto.in_flight}); it answers pings but not the round",
                        "verdict",
                    ) from None
            except BaseException as exc:  # a broken connection reaches the loop as an exception
                await queue.put((exc, clock()))
                return
            # stamped on arrival: the loop may be busy drafting when it comes, and the round trip
            # (stats, dynamic budgets, the cost gate) must not count that wait
            await queue.put((msg, clock()))


__all__ = ["DraftStep", "RoundExecutor"]
