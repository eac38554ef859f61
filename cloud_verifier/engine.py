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
from collections.abc import Callable

import numpy as np

from cloud_verifier.step import EngineConfig, RoundResult, SeqState, SeqStatus, StepRunner
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
        self._last_step_s = 0.0
        self.on_step: Callable[[int, int, float], None] | None = None  # (rows, sessions, seconds)
        self.cost_ms: dict[int, float] = {}  # the measured verify cost curve (rows: ms), for stall checks
        self._step_started: float | None = None
        self._step_expected_s = 0.0
        self._slowest_s = 0.0
        self.checks: list[Callable[[], bool]] = []  # more readiness conditions (parallel: ranks alive)

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
        self.runner.close(s)
        self._wake_if_ready()

    def start(self, s: SeqState, prompt: Prompt, committed: np.ndarray, *, ignore_eos: bool = False) -> None:
        """Begin a generation: committed = cached context (if continuing) + the new prompt tokens.
        `ignore_eos`: end-of-text ids do not end it (the prompt's own stop ids still do)."""
        self._note_pending()
        self.runner.start(s, prompt, committed, ignore_eos=ignore_eos)
        self._wake.set()

    def end(self, s: SeqState) -> None:
        """The session's generation ended outside the engine (a cancel with no round in flight)."""
        self._note_pending()
        self.runner.end(s)
        self._wake_if_ready()

    def _wake_if_ready(self) -> None:
        if self.pending_work:
            self._wake.set()

    def submit(self, s: SeqState, round_id: int, tree: TokenTree | None) -> None:
        self._note_pending()
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
        seen so far."""
        curve = self.cost_ms
        if not curve:
            return self._slowest_s
        top = max(curve)
        if rows > top:
            return curve[top] * rows / top / 1e3
        return curve[min(n for n in curve if n >= rows)] / 1e3

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
            await self._gather()
            plan = self.runner.plan()
            if not plan:  # (the ready rounds wait for KV room: until a session submits, ends or closes)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await self._wake.wait()
                continue
            rows = sum(p.rows for p in plan)
            self._step_expected_s = self._expected_s(rows)
            self._step_started = time.monotonic()
            t0 = time.perf_counter()
            done = await loop.run_in_executor(self._executor, self.runner.execute, plan)
            dt = time.perf_counter() - t0
            self._step_started = None
            self._slowest_s = max(self._slowest_s, dt)
            self._last_step_s = dt
            self.steps += 1
            self.last_step_end = time.monotonic()
            if self.on_step is not None:
                self.on_step(rows, len(plan), dt)
            self.runner.finish(done, dt)
            await asyncio.sleep(0)  # let sessions' I/O run between steps

    async def _gather(self) -> None:
        """Give sessions that are between rounds a moment to join this step (see gather_ms)."""
        cfg = self.config
        if not cfg.batching or cfg.gather_ms <= 0:
            return
        deadline = time.perf_counter() + min(cfg.gather_ms / 1e3, self._last_step_s / 4)
        while True:
            between = any(s.status is SeqStatus.WAITING for s in self.seqs.values())
            left = deadline - time.perf_counter()
            if not between or left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return
