"""Continuous batching (Orca-style iteration-level scheduling) of every session's ready work.

Each engine step packs the ready rounds of all sessions (chunked prefills, tree rounds, `ar` steps)
up to a row budget into ONE forward of the target, verifies each session's round, commits the
accepted rows' KV and hands the outcome back to the session on the event-loop thread. Sessions join
and leave between steps; a round-robin start point keeps any session from starving.

The step itself is step.py's `StepRunner` (plan -> packed forward -> verify -> commit -> results),
synchronous and testable without asyncio; what a step packs is its `plan_step`; the state it
works on (`SeqState`, `Job`, `EngineConfig`) is step.py's too. This module only schedules steps
and reports health: it plans and finishes each step on the event loop's thread and runs the
forward on one worker thread, so pings, /readyz and other sessions' I/O keep flowing during a
long prefill.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from cloud_verifier.batch_wait import ArrivalPredictor, plan_wait, wait_bound_ms
from cloud_verifier.live_cost import LiveCost
from cloud_verifier.step import EngineConfig, Planned, RoundResult, SeqState, SeqStatus, StepRunner
from shared.messages import Prompt
from shared.model import Target
from shared.model.kv_cache import PagedKVCache
from shared.tree import TokenTree


class Engine:
    """Schedules `StepRunner` steps on a worker thread and reports health. Sessions' state is
    touched on the event loop's thread only; the worker runs `StepRunner.execute` (step.py lists
    which thread touches what)."""

    def __init__(self, target: Target, kv: PagedKVCache, config: EngineConfig | None = None) -> None:
        self.runner = StepRunner(target, kv, config or EngineConfig())
        self.target = target
        self.kv = kv
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.last_step_end = time.monotonic()
        self._pending_since = self.last_step_end  # when ready work last appeared in an idle engine
        self.on_step: Callable[[int, int, float], None] | None = None  # (rows, sessions, seconds)
        self.cost_ms: dict[int, float] = {}  # the measured verify cost curve (rows: ms), for stall checks
        self._step_started: float | None = None
        self._step_expected_s = 0.0
        self._slowest_s = 0.0
        self.checks: list[Callable[[], bool]] = []  # more readiness conditions (parallel: ranks alive)
        # the live verify cost curve (live_cost.py): fed every step, cost_ms refreshed from it
        self.live_cost: LiveCost | None = None
        self._next_rows: dict[int, int] = {}  # sid: the rows its next round is expected to feed
        # the batch wait (_gather): each session's next round predicted from its gaps, and each
        # forward's wait in seconds, drained by Metrics.record_pool (bounded if nobody drains it)
        self.arrivals = ArrivalPredictor()
        self.batch_waits: deque[float] = deque(maxlen=4096)
        self.waited_forwards = 0

    @property
    def config(self) -> EngineConfig:
        return self.runner.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self.runner.config = config

    @property
    def seqs(self) -> dict[int, SeqState]:
        return self.runner.seqs

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    @property
    def sync_free(self) -> bool:
        return self.runner.sync_free

    @sync_free.setter
    def sync_free(self, on: bool) -> None:
        self.runner.sync_free = on

    # ------------------------------------------------------------------ sessions (loop thread)
    def open(self, on_result: Callable[[RoundResult], None]) -> SeqState:
        return self.runner.open(on_result)

    def close(self, s: SeqState) -> None:
        """Forget a session; its KV blocks are freed now, or right after the step it is part of.
        Generations waiting for KV room that now fit become ready."""
        self._note_pending()
        self.arrivals.forget(s.sid)
        self._next_rows.pop(s.sid, None)
        self.runner.close(s)
        self._wake_if_ready()

    def start(self, s: SeqState, prompt: Prompt, committed: np.ndarray, *, ignore_eos: bool = False) -> None:
        """Begin a generation: committed = cached context (if continuing) + the new prompt tokens.
        `ignore_eos`: end-of-text ids do not end it (the prompt's own stop ids still do)."""
        self._note_pending()
        self.arrivals.idle(s.sid)
        self.runner.start(s, prompt, committed, ignore_eos=ignore_eos)
        self._wake.set()

    def end(self, s: SeqState) -> None:
        """The session's generation ended outside the engine (a cancel with no round in flight)."""
        self._note_pending()
        self.arrivals.idle(s.sid)
        self.runner.end(s)
        self._wake_if_ready()

    def _wake_if_ready(self) -> None:
        if self.pending_work:
            self._wake.set()

    def submit(self, s: SeqState, round_id: int, tree: TokenTree | None) -> None:
        self._note_pending()
        self.arrivals.submitted(s.sid, time.perf_counter())
        if self.runner.submit(s, round_id, tree):
            self._wake.set()

    def _note_pending(self) -> None:
        if not self.pending_work:  # ready work waits from now on (see healthy)
            self._pending_since = time.monotonic()

    @property
    def pending_work(self) -> bool:
        return self.runner.ready > 0

    @property
    def waiting(self) -> int:
        """Rounds ready and not in the step now running."""
        return self.runner.ready

    @property
    def queued(self) -> int:
        """Generations waiting for room in the KV pool before their prefill."""
        return self.runner.queued

    @property
    def preemptions(self) -> int:
        """Sessions whose KV blocks were freed for another's round (recomputed later), so far."""
        return self.runner.room.preemptions

    def healthy(self) -> bool:
        """False when the loop died, a step has run far past its expected time, or ready work has
        waited stall_s with no step running (a round that waits for room in the KV pool is not
        stalled: it runs when a session that holds the room ends or submits). The wait counts from
        the later of the last step's end and the moment work became ready in an idle engine:
        measured from the last step alone, the first round after stall_s of idling looked stalled
        until its step began."""
        if self._task is None or self._task.done() or not all(check() for check in self.checks):
            return False
        now = time.monotonic()
        if self._step_started is not None:
            limit = max(self.config.stall_s, self.config.stall_factor * self._step_expected_s)
            return now - self._step_started <= limit
        waiting_since = max(self.last_step_end, self._pending_since)
        stalled = self.pending_work and not self.runner.waiting_for_room
        return not (stalled and now - waiting_since > self.config.stall_s)

    def _expected_s(self, rows: int) -> float:
        """What a forward of `rows` rows should take: the measured verify cost curve at the first
        measured N >= rows, linear past its end (long prefills); without a curve, the slowest step
        seen so far. With a live curve: its forward of `rows` rows."""
        if self.live_cost is not None:
            return self.live_cost.forward_ms(rows - 1) / 1e3
        curve = self.cost_ms
        if not curve:
            return self._slowest_s
        top = max(curve)
        if rows > top:
            return curve[top] * rows / top / 1e3
        return curve[min(n for n in curve if n >= rows)] / 1e3

    def _note_rows(self, plan: list[Planned]) -> None:
        """Each planned session's next round: row 0 + this round's nodes (a prefill chunk: another
        chunk as large)."""
        for p in plan:
            tree = p.job.tree
            nodes = tree.num_nodes if tree is not None else 0
            self._next_rows[p.seq.sid] = 1 + nodes if p.final else len(p.pre)

    def other_rows(self, sid: int) -> int:
        """The rows the next forward is expected to hold from sessions other than `sid`: each other
        session with a generation running (between rounds, queued for a step or in one) feeds as many
        rows as its last round (row 0 + its tree's nodes; 1 before its first), none without batching.
        The last round is the best guess of the next: trees drafted by the same edge."""
        if not self.config.batching:
            return 0
        running = (SeqStatus.WAITING, SeqStatus.READY, SeqStatus.RUNNING)
        others = (s.sid for s in self.seqs.values() if s.sid != sid and s.status in running)
        return sum(self._next_rows.get(o, 1) for o in others)

    # ------------------------------------------------------------------ the loop
    def start_loop(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.pending_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            waited = await self._gather()
            plan = self.runner.plan()
            if not plan:  # (the ready rounds wait for KV room: until a session submits, ends or closes)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await self._wake.wait()
                continue
            self.batch_waits.append(waited)
            self.waited_forwards += 1 if waited > 0 else 0
            rows = sum(p.rows for p in plan)
            self._note_rows(plan)
            self._step_expected_s = self._expected_s(rows)
            self._step_started = time.monotonic()
            t0 = time.perf_counter()
            done = await loop.run_in_executor(self._executor, self.runner.execute, plan)
            dt = time.perf_counter() - t0
            self._step_started = None
            self._slowest_s = max(self._slowest_s, dt)
            self.steps += 1
            self.last_step_end = time.monotonic()
            if self.live_cost is not None:  # before the verdicts: they carry the refreshed curve
                self.live_cost.observe(rows, dt, sum(len(p.seq.committed) for p in plan))
                if self.cost_ms:  # (none measured: it stays empty, as without a live curve)
                    self.cost_ms = self.live_cost.curve()
            if self.on_step is not None:
                self.on_step(rows, len(plan), dt)
            self.runner.finish(done, dt)
            now = time.perf_counter()
            for o in done.outcomes:  # left between rounds (no pending tree): its next round is a gap away
                s, tree = o.planned.seq, o.planned.job.tree
                if s.status is SeqStatus.WAITING:
                    self.arrivals.verdict(s.sid, now, 1 + (tree.num_nodes if tree is not None else 0))
            await asyncio.sleep(0)  # let sessions' I/O run between steps

    async def _gather(self) -> float:
        """Before a step, wait for sessions between rounds whose next round is about to arrive,
        only as long as the cost curve says it pays (batch_wait.py: the rule, from `cost_ms` read
        afresh each time), never past gather_ms nor half the ready rows' forward; re-decided at
        every submit while it waits, and going when an expected round is late. Returns the seconds
        it waited (0: none), which the loop puts in `batch_waits` (drained into
        cloud_verifier_batch_wait_seconds) and `waited_forwards`."""
        cfg = self.config
        if not cfg.batching or cfg.gather_ms <= 0:
            return 0.0
        t0 = time.perf_counter()
        waited = False
        bound_ms = wait_bound_ms(self.cost_ms, self._ready_rows()[0], cfg.gather_ms)  # by the rows ready now
        while True:
            now = time.perf_counter()
            rows, sessions = self._ready_rows()
            left_ms = bound_ms - (now - t0) * 1e3
            arrivals = [
                a
                for s in self.seqs.values()
                if s.status is SeqStatus.WAITING and (a := self.arrivals.expected(s.sid, now)) is not None
            ]
            w_ms = plan_wait(self.cost_ms, rows, sessions, arrivals, left_ms) if arrivals else 0.0
            if w_ms <= 0:
                return time.perf_counter() - t0 if waited else 0.0
            waited = True
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), w_ms / 1e3)

    def _ready_rows(self) -> tuple[int, int]:
        """The rows the next step would feed (each ready session's uncached committed tokens and
        tree nodes, at most the token budget) and the ready sessions."""
        rows = sessions = 0
        for s in self.seqs.values():
            if s.status is SeqStatus.READY and s.job is not None:
                nodes = s.job.tree.num_nodes if s.job.tree is not None else 0
                rows += len(s.committed) - self.kv.cached_len(s.sid) + nodes
                sessions += 1
        return min(rows, self.config.token_budget), sessions
