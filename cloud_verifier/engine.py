"""Continuous batching (Orca-style iteration-level scheduling) of every session's ready work.

Each engine step packs the ready rounds of all sessions (chunked prefills, tree rounds, `ar` steps)
up to a row budget into ONE forward of the target, verifies each session's round, commits the
accepted rows' KV and hands the outcome back to the session on the event-loop thread. Sessions join
and leave between steps; a round-robin start point keeps any session from starving. The forward runs
on a worker thread, so pings, /readyz and other sessions' I/O keep flowing during a long prefill.

What a step packs is planning.py's `plan_step`; the state it works on (sessions, jobs, results, the
config) is in engine_state.py.

A round's rows (docs/architecture.md §3.1): the committed tokens not yet in the KV cache (normally
just row 0, the previous bonus; the whole prompt at prefill) and then the tree nodes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from cloud_verifier.engine_state import EngineConfig, Job, Outcome, Planned, RoundResult, SeqState
from shared.model.kv_cache import KVCacheFull, PagedKVCache
from shared.model import SeqInput, Target, prefill_chunk, round_keep, tree_round
from cloud_verifier.planning import plan_step
from cloud_verifier.sampling import sample_next_async
from cloud_verifier.verify import (
    Algorithm,
    SamplingParams,
    read_verdicts,
    sample_next,
    unpack_verdict,
    verify_tree,
    verify_tree_async,
)
from shared.errors import ErrorCode, ProtocolError
from shared.messages import Mode, Prompt
from shared.tree import TokenTree

log = logging.getLogger(__name__)


class Engine:
    """Owns the target and the KV pool; everything but the forward runs on the event-loop thread."""

    def __init__(self, target: Target, kv: PagedKVCache, config: EngineConfig | None = None) -> None:
        self.target = target
        self.kv = kv
        self.config = config or EngineConfig()
        self.eos_ids = frozenset(target.eos_ids)
        self.seqs: dict[int, SeqState] = {}
        self._next_sid = 1
        self._rr = 0
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.forwards = 0
        self.last_step_end = time.monotonic()
        self._pending_since = self.last_step_end  # when ready work last appeared in an idle engine
        self._last_step_s = 0.0
        self.on_step: Callable[[int, int, float], None] | None = None  # (rows, sessions, seconds)
        self.cost_ms: dict[int, float] = {}  # the measured verify cost curve (rows: ms), for stall checks
        self._step_started: float | None = None
        self._step_expected_s = 0.0
        self._slowest_s = 0.0
        self.checks: list[Callable[[], bool]] = []  # more readiness conditions (parallel: ranks alive)
        # off the CPU, verdicts stay on the device until one copy per step (verify.read_verdicts)
        self.sync_free = target.device.type != "cpu"

    # ------------------------------------------------------------------ sessions (loop thread)
    def open(self, on_result: Callable[[RoundResult], None]) -> SeqState:
        sid = self._next_sid
        self._next_sid += 1
        self.kv.add(sid)
        s = SeqState(sid=sid, on_result=on_result)
        self.seqs[sid] = s
        return s

    def close(self, s: SeqState) -> None:
        """Forget a session; its KV blocks are freed now, or right after the step it is part of."""
        s.closed = True
        s.job = None
        if not s.busy:
            self._release(s)

    def _release(self, s: SeqState) -> None:
        if self.seqs.pop(s.sid, None) is not None:
            self.kv.free(s.sid)

    def start(self, s: SeqState, prompt: Prompt, committed: np.ndarray) -> None:
        """Begin a generation: committed = cached context (if continuing) + the new prompt tokens."""
        mode = prompt.mode
        temp = 0.0 if mode is Mode.GREEDY else prompt.temperature
        s.params = SamplingParams(temperature=temp, top_k=prompt.top_k, top_p=prompt.top_p)
        s.mode = mode
        s.seed = prompt.seed
        s.generator = torch.Generator(device=self.target.device).manual_seed(prompt.seed)
        new = [int(t) for t in committed]
        cached = self.kv.cached_len(s.sid)
        if cached and (len(new) <= cached or new[:cached] != s.committed[:cached]):
            # a new conversation: the cached context is not a prefix of it
            self.kv.free(s.sid)
            self.kv.add(s.sid)
        s.committed = new
        s.prompt_len = len(new)
        s.max_new_tokens = prompt.max_new_tokens
        s.stop_ids = self.eos_ids | frozenset(prompt.stop_ids)
        s.active = True
        self.submit(s, 0, prompt.tree)

    def end(self, s: SeqState) -> None:
        """The session's generation ended outside the engine (a cancel with no round in flight)."""
        s.active = False

    def submit(self, s: SeqState, round_id: int, tree: TokenTree | None) -> None:
        if s.closed:
            return
        assert s.job is None, "one round in flight per session"
        if not self.pending_work:  # ready work waits from now on (see healthy)
            self._pending_since = time.monotonic()
        s.job = Job(round_id, tree)
        self._wake.set()

    @property
    def pending_work(self) -> bool:
        return any(s.job is not None and not s.busy for s in self.seqs.values())

    @property
    def waiting(self) -> int:
        """Rounds ready and not in the step now running."""
        return sum(1 for s in self.seqs.values() if s.job is not None and not s.busy)

    def healthy(self) -> bool:
        """False when the loop died, a step has run far past its expected time, or ready work has
        waited stall_s with no step running. The wait counts from the later of the last step's end
        and the moment work became ready in an idle engine: measured from the last step alone, the
        first round after stall_s of idling looked stalled until its step began."""
        if self._task is None or self._task.done() or not all(check() for check in self.checks):
            return False
        now = time.monotonic()
        if self._step_started is not None:
            limit = max(self.config.stall_s, self.config.stall_factor * self._step_expected_s)
            return now - self._step_started <= limit
        waiting_since = max(self.last_step_end, self._pending_since)
        return not (self.pending_work and now - waiting_since > self.config.stall_s)

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
            plan = self._plan()
            if not plan:
                await asyncio.sleep(0.001)
                continue
            for p in plan:
                p.seq.busy = True
            self._step_expected_s = self._expected_s(sum(p.rows for p in plan))
            self._step_started = time.monotonic()
            t0 = time.perf_counter()
            try:
                outcomes = await loop.run_in_executor(self._executor, self._step, plan)
            except Exception:
                # the packed forward failed: nothing was committed, so run each session alone and
                # let only the one whose input breaks it fail (a step is never shared fate)
                log.exception("engine step of %d sessions failed; retrying each alone", len(plan))
                outcomes = await self._isolate(plan)
            dt = time.perf_counter() - t0
            self._step_started = None
            self._slowest_s = max(self._slowest_s, dt)
            self._last_step_s = dt
            self.steps += 1
            self.last_step_end = time.monotonic()
            if self.on_step is not None:
                self.on_step(sum(p.rows for p in plan), len(plan), dt)
            for p, result, err in outcomes:
                self._finish(p, result, err, dt)
            await asyncio.sleep(0)  # let sessions' I/O run between steps

    async def _isolate(self, plan: list[Planned]) -> list[Outcome]:
        loop = asyncio.get_running_loop()
        out: list[Outcome] = []
        for p in plan:
            self.kv.discard(p.seq.sid)
        for p in plan:
            try:
                out += await loop.run_in_executor(self._executor, self._step, [p])
            except Exception as exc:
                log.exception("engine step failed for session %d", p.seq.sid)
                self.kv.discard(p.seq.sid)
                out.append((p, None, _internal(exc, p)))
        return out

    async def _gather(self) -> None:
        """Give sessions that are between rounds a moment to join this step (see gather_ms)."""
        cfg = self.config
        if not cfg.batching or cfg.gather_ms <= 0:
            return
        deadline = time.perf_counter() + min(cfg.gather_ms / 1e3, self._last_step_s / 4)
        while True:
            between = [
                s for s in self.seqs.values() if s.active and s.job is None and not s.busy and not s.closed
            ]
            left = deadline - time.perf_counter()
            if not between or left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _plan(self) -> list[Planned]:
        plan = plan_step(self.seqs.values(), self.kv, self.config, self._rr)
        self._rr += 1 if plan else 0
        return plan

    # ------------------------------------------------------------------ worker thread
    def _step(self, plan: list[Planned]) -> list[Outcome]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            try:
                inputs = [self._inputs(p) for p in plan]
                logits = self.target.model.forward_packed(inputs, self.kv)
            except KVCacheFull:
                if len(plan) == 1:
                    err = ProtocolError(
                        ErrorCode.BUSY,
                        "the verifier's KV cache is full; retry later or shorten the context",
                        None,
                        round=plan[0].job.round,
                    )
                    return [(plan[0], None, err)]
                half = len(plan) // 2  # fewer sessions this step; the rest wait for the next
                for p in plan[half:]:
                    p.seq.busy = False
                return self._step(plan[:half])
            self.forwards += 1
            out: list[Outcome] = []
            pending: list[tuple[int, torch.Tensor | tuple[list[int], list[int]]]] = []
            for p, lg in zip(plan, logits, strict=True):
                if not p.final:
                    self.kv.commit_rows(p.seq.sid, list(range(len(p.pre))))
                    out.append((p, None, None))
                    continue
                try:
                    pending.append((len(out), self._verdict(p, lg)))
                except Exception as exc:  # this session's round fails alone
                    log.exception("verification failed for session %d", p.seq.sid)
                    out.append((p, None, _internal(exc, p)))
                    continue
                out.append((p, None, None))
            on_device = [v for _, v in pending if isinstance(v, torch.Tensor)]
            read = iter(read_verdicts(on_device))  # the step's one device -> host copy
            for i, v in pending:
                p = out[i][0]
                try:
                    tokens, accepted = v if isinstance(v, tuple) else _unpack(p, next(read))
                    out[i] = (p, self._commit(p, tokens, accepted, t0), None)
                except Exception as exc:
                    log.exception("verification failed for session %d", p.seq.sid)
                    out[i] = (p, None, _internal(exc, p))
        return out

    def _inputs(self, p: Planned) -> SeqInput:
        s = p.seq
        tree = p.job.tree if p.final else None
        if tree is None or tree.num_nodes == 0:
            inp = prefill_chunk(s.sid, p.pre, self.kv.cached_len(s.sid), logits_last=p.final)
        else:
            inp = tree_round(s.sid, tree, p.pre, all_logits=False)
        dev = self.target.device
        if dev.type == "cpu":
            return inp
        mask = inp.tree_mask.to(dev) if inp.tree_mask is not None else None
        return SeqInput(inp.seq_id, inp.tokens.to(dev), inp.positions.to(dev), mask, inp.logit_rows.to(dev))

    def _verify(self, p: Planned, logits: torch.Tensor, t0: float) -> RoundResult:
        """Verify, cut at the stop conditions, commit KV. logits: [1 + N, V] (row 0, then the nodes)."""
        v = self._verdict(p, logits)
        tokens, accepted = v if isinstance(v, tuple) else _unpack(p, read_verdicts([v])[0])
        return self._commit(p, tokens, accepted, t0)

    def _verdict(self, p: Planned, logits: torch.Tensor) -> torch.Tensor | tuple[list[int], list[int]]:
        """The round's (tokens, accepted nodes), or with `sync_free` the verdict still on the device
        (`verify_tree_async`'s packing; an `ar` step: [1] the token)."""
        s, tree = p.seq, p.job.tree
        L = len(s.committed)
        if tree is None or tree.num_nodes == 0:
            if self.sync_free:
                return sample_next_async(logits[0], s.params, s.seed, L)
            return [sample_next(logits[0], s.params, s.seed, L)], []
        if self.sync_free:
            return verify_tree_async(
                Algorithm.of(s.mode, s.params), tree, logits, s.params, seed=s.seed, generator=s.generator
            )
        res = verify_tree(
            Algorithm.of(s.mode, s.params), tree, logits, s.params, seed=s.seed, generator=s.generator
        )
        return list(res.tokens), list(res.accepted_nodes)

    def _commit(self, p: Planned, tokens: list[int], accepted: list[int], t0: float) -> RoundResult:
        """Cut the verdict at the stop conditions and commit the kept rows' KV."""
        s, tree = p.seq, p.job.tree
        L = len(s.committed)
        generated = L - s.prompt_len
        room_len = s.max_new_tokens - generated
        room_ctx = self.config.max_context - L
        room = max(1, min(room_len, room_ctx))
        out: list[int] = []
        reason = None
        for t in tokens:
            out.append(t)
            if t in s.stop_ids:
                reason = "stop"
                break
            if len(out) >= room:
                reason = "length" if room_len <= room_ctx else "context"
                break
        has_bonus = len(out) == len(accepted) + 1
        acc = accepted[: len(out)]
        # the last committed token is never cached: keep the nodes before it
        keep_nodes = accepted if has_bonus else acc[:-1]
        self.kv.commit_rows(s.sid, round_keep(len(p.pre), keep_nodes))
        depths = [int(tree.depth[i]) for i in acc] if tree is not None else []
        return RoundResult(
            round=p.job.round,
            tokens=out,
            accepted_nodes=acc,
            has_bonus=has_bonus,
            committed_len=L + len(out),
            verify_ms=(time.perf_counter() - t0) * 1e3,
            done=reason is not None,
            reason=reason,
            tree_nodes=tree.num_nodes if tree is not None else 0,
            accepted_depths=depths,
        )

    # ------------------------------------------------------------------ back on the loop thread
    def _finish(self, p: Planned, result: RoundResult | None, err: ProtocolError | None, dt: float) -> None:
        s = p.seq
        s.busy = False
        if s.closed:
            self._release(s)
            return
        if result is None and err is None:
            return  # a prefill chunk: the job stays ready for the next step
        s.job = None
        if err is not None:
            self.kv.discard(s.sid)
            result = RoundResult(
                p.job.round, [], [], False, len(s.committed), dt * 1e3, True, "error", error=err
            )
        assert result is not None
        result.round_s = time.perf_counter() - p.job.ready_at
        s.committed.extend(result.tokens)
        if result.done:
            s.active = False
        s.on_result(result)


def _internal(exc: Exception, p: Planned) -> ProtocolError:
    return ProtocolError(ErrorCode.INTERNAL, f"verifier error: {exc}", None, fatal=True, round=p.job.round)


def _unpack(p: Planned, values: list[int]) -> tuple[list[int], list[int]]:
    """A verdict read back from the device: an `ar` step's [token], or a tree's packed verdict."""
    tree = p.job.tree if p.final else None
    if tree is None or tree.num_nodes == 0:
        return [int(values[0])], []
    res = unpack_verdict(values, tree)
    return list(res.tokens), list(res.accepted_nodes)
