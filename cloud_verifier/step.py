"""One engine step, synchronously: plan -> packed forward -> verify -> commit -> results.

`StepRunner.step` is the diagram of docs/architecture.md §2 in code, and how tests drive the engine
without an event loop. The asyncio `Engine` (engine.py) only schedules the same three phases and
reports health: `plan` and `finish` on the event loop's thread, `execute` on its worker thread.

Which thread touches what (docs/architecture.md §5):

- The event loop's thread owns every `SeqState`: its status, job, committed sequence and
  generation settings change only there (`open`, `start`, `submit`, `end`, `close`, `plan`,
  `finish`). It adds and frees KV sequences of sessions that are not in the running step, and,
  in `plan` (between steps), frees the blocks `KVRoom.fit` reclaims or preempts.
- The worker thread runs `execute`: the target's forward, and the KV rows of the planned sessions
  (reserve, write, commit, discard). It reads the planned sessions' committed tokens, job and
  sampling settings, which nothing changes while a session is RUNNING, and writes only their
  sampling generator (verification draws from it) and the pool. The pool's bookkeeping is under
  its own lock, so the loop's add/free of other sessions never races the step's reserve.

A round's rows (docs/architecture.md §3.1): the committed tokens not yet in the KV cache (normally
just row 0, the previous bonus; the whole prompt at prefill) and then the tree nodes.

The engine's state, as plain dataclasses (a session's generation `SeqState` with its status
`SeqStatus`, the round it wants verified `Job`, a round's outcome `RoundResult`, the engine's
config, one session's part of a step `Planned`, and what the stages hand each other), is in
cloud_verifier.step_state; this module re-exports it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from cloud_verifier.kv_room import KVRoom, worst_positions
from cloud_verifier.sampling import SamplingParams, sample_next_async
from cloud_verifier.step_state import (
    TRANSITIONS,
    EngineConfig,
    IllegalTransition,
    Job,
    Packed,
    Planned,
    RoundResult,
    SeqState,
    SeqStatus,
    StepDone,
    StepOutcome,
    StepVerdict,
)
from cloud_verifier.verify import (
    Algorithm,
    read_verdicts,
    sample_next,
    unpack_verdict,
    verify_tree,
    verify_tree_async,
)
from shared.errors import ErrorCode, ProtocolError
from shared.messages import Mode, Prompt
from shared.model import SeqInput, Target, prefill_chunk, round_keep, tree_round
from shared.model.kv_cache import KVCacheFull, PagedKVCache
from shared.tree import TokenTree

log = logging.getLogger("cloud_verifier.engine")


# ---------------------------------------------------------------------------------------------------
# The step runner


class StepRunner:
    """The sessions' state and one step over it; no asyncio, no threads of its own."""

    def __init__(self, target: Target, kv: PagedKVCache, config: EngineConfig) -> None:
        self.target = target
        self.kv = kv
        self.config = config
        self.eos_ids = frozenset(target.eos_ids)
        self.seqs: dict[int, SeqState] = {}
        self.room = KVRoom(kv)  # which generations hold room in the pool, which wait for it
        self.forwards = 0  # packed forwards run (a KV-full retry with fewer sessions counts once)
        # off the CPU, verdicts stay on the device until one copy per step (verify.read_verdicts)
        self.sync_free = target.device.type != "cpu"
        self._next_sid = 1
        self._rr = 0  # round-robin start among ready sessions
        # the last plan left every ready round out for want of KV room: the engine waits for a
        # session to submit, end or close (not a stalled loop)
        self.waiting_for_room = False

    # ------------------------------------------------------------------ the step, top to bottom
    def step(self) -> list[RoundResult]:
        """Plan, run and finish one step on this thread; the results handed to the sessions."""
        plan = self.plan()
        if not plan:
            return []
        t0 = time.perf_counter()
        done = self.execute(plan)
        return self.finish(done, time.perf_counter() - t0)

    def plan(self) -> list[Planned]:
        """Loop thread: the step's rounds (`plan_step`) that the KV pool holds (`KVRoom.fit` frees
        reclaimable blocks, or preempts, for them; a round left out waits for a later step); their
        sessions become RUNNING."""
        planned = plan_step(self.seqs.values(), self.kv, self.config, self._rr)
        runs, preempted = self.room.fit([(p.seq.sid, p.rows) for p in planned])
        if preempted:
            log.info("KV pool full: sessions %s preempted (to be recomputed from their tokens)", preempted)
        plan = [p for p in planned if p.seq.sid in runs]
        self.waiting_for_room = bool(planned) and not plan
        self._rr += 1 if plan else 0
        for p in plan:
            p.seq.move(SeqStatus.RUNNING)
        return plan

    def execute(self, plan: list[Planned]) -> StepDone:
        """Worker thread: packed forward -> verify -> one device read -> commit.

        A failing packed forward commits nothing; each session then runs alone, so only the one
        whose input breaks it fails (a step is never shared fate)."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            try:
                packed = self.forward(plan)
            except Exception:
                log.exception("engine step of %d sessions failed; retrying each alone", len(plan))
                return self._isolate(plan)
            verdicts = self.read(self.verify(packed))
            outcomes = self.commit(verdicts, t0)
        return StepDone([*outcomes, *packed.refused], packed.deferred)

    def finish(self, done: StepDone, seconds: float) -> list[RoundResult]:
        """Loop thread: deferred rounds wait again; each result goes to its session."""
        for p in done.deferred:
            self._unrun(p.seq)
        results = [self._deliver(o, seconds) for o in done.outcomes]
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------ stages (worker thread)
    def forward(self, plan: list[Planned]) -> Packed:
        """One packed forward of every planned round's rows. When the KV pool cannot hold them,
        half the rounds wait for the next step; a single round it cannot hold is refused (BUSY)."""
        deferred: list[Planned] = []
        while True:
            try:
                logits = self.target.model.forward_packed([self.inputs(p) for p in plan], self.kv)
            except KVCacheFull:
                if len(plan) > 1:
                    half = len(plan) // 2
                    deferred, plan = plan[half:] + deferred, plan[:half]
                    continue
                busy = ProtocolError(
                    ErrorCode.BUSY,
                    "the verifier's KV cache is full; retry later or shorten the context",
                    None,
                    round=plan[0].job.round,
                )
                return Packed([], [], deferred, [StepOutcome(plan[0], error=busy)])
            self.forwards += 1
            return Packed(plan, logits, deferred)

    def inputs(self, p: Planned) -> SeqInput:
        """A planned round as the forward's input: a prefill chunk, or row 0 and the tree."""
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

    def verify(self, packed: Packed) -> list[StepVerdict]:
        """Each final round's verdict from its logits ([1 + N, V]: row 0, then the nodes); a
        session whose verification fails gets an error, alone."""
        verdicts = []
        for p, logits in zip(packed.rounds, packed.logits, strict=True):
            v = StepVerdict(p)
            if p.final:
                try:
                    self._verdict(v, logits)
                except Exception as exc:
                    log.exception("verification failed for session %d", p.seq.sid)
                    v.error = _internal(exc, p)
            verdicts.append(v)
        return verdicts

    def _verdict(self, v: StepVerdict, logits: torch.Tensor) -> None:
        s, tree = v.planned.seq, v.planned.job.tree
        at = len(s.committed)
        if tree is None or tree.num_nodes == 0:  # an `ar` step or a prompt's first token
            if self.sync_free:
                v.device = sample_next_async(logits[0], s.params, s.seed, at)
            else:
                v.tokens = [sample_next(logits[0], s.params, s.seed, at)]
        elif self.sync_free:
            algorithm = Algorithm.of(s.mode, s.params)
            v.device = verify_tree_async(
                algorithm, tree, logits, s.params, seed=s.seed, generator=s.generator
            )
        else:
            algorithm = Algorithm.of(s.mode, s.params)
            res = verify_tree(algorithm, tree, logits, s.params, seed=s.seed, generator=s.generator)
            v.tokens, v.accepted = list(res.tokens), list(res.accepted_nodes)

    def read(self, verdicts: list[StepVerdict]) -> list[StepVerdict]:
        """The step's one device -> host copy of every verdict still on the device."""
        on_device = [(v, v.device) for v in verdicts if v.device is not None and v.error is None]
        read = read_verdicts([packed for _, packed in on_device])
        for (v, _), values in zip(on_device, read, strict=True):
            try:
                v.tokens, v.accepted = _unpack(v.planned, values)
            except Exception as exc:
                log.exception("verification failed for session %d", v.planned.seq.sid)
                v.error = _internal(exc, v.planned)
        return verdicts

    def commit(self, verdicts: list[StepVerdict], t0: float) -> list[StepOutcome]:
        """Commit each round's kept KV rows: a prefill chunk's rows, or the verdict cut at the stop
        conditions."""
        outcomes = []
        for v in verdicts:
            p = v.planned
            if v.error is not None:
                outcomes.append(StepOutcome(p, error=v.error))
            elif not p.final:
                self.kv.commit_rows(p.seq.sid, list(range(len(p.pre))))
                outcomes.append(StepOutcome(p))
            else:
                try:
                    outcomes.append(StepOutcome(p, self._cut_and_commit(v, t0)))
                except Exception as exc:
                    log.exception("verification failed for session %d", p.seq.sid)
                    outcomes.append(StepOutcome(p, error=_internal(exc, p)))
        return outcomes

    def _cut_and_commit(self, v: StepVerdict, t0: float) -> RoundResult:
        """Cut the verdict at the stop conditions and commit the kept rows' KV."""
        p = v.planned
        s, tree = p.seq, p.job.tree
        length = len(s.committed)
        room_len = s.max_new_tokens - (length - s.prompt_len)
        room_ctx = self.config.max_context - length
        room = max(1, min(room_len, room_ctx))
        out: list[int] = []
        reason = None
        for t in v.tokens:
            out.append(t)
            if t in s.stop_ids:
                reason = "stop"
                break
            if len(out) >= room:
                reason = "length" if room_len <= room_ctx else "context"
                break
        has_bonus = len(out) == len(v.accepted) + 1
        acc = v.accepted[: len(out)]
        # the last committed token is never cached: keep the nodes before it
        keep_nodes = v.accepted if has_bonus else acc[:-1]
        self.kv.commit_rows(s.sid, round_keep(len(p.pre), keep_nodes))
        return RoundResult(
            round=p.job.round,
            tokens=out,
            accepted_nodes=acc,
            has_bonus=has_bonus,
            committed_len=length + len(out),
            verify_ms=(time.perf_counter() - t0) * 1e3,
            done=reason is not None,
            reason=reason,
            tree_nodes=tree.num_nodes if tree is not None else 0,
            accepted_depths=[int(tree.depth[i]) for i in acc] if tree is not None else [],
        )

    def _isolate(self, plan: list[Planned]) -> StepDone:
        """Each round of a failed packed forward alone (the first attempt committed nothing)."""
        for p in plan:
            self.kv.discard(p.seq.sid)
        outcomes: list[StepOutcome] = []
        for p in plan:
            t0 = time.perf_counter()
            try:
                packed = self.forward([p])
                outcomes += [*self.commit(self.read(self.verify(packed)), t0), *packed.refused]
            except Exception as exc:
                log.exception("engine step failed for session %d", p.seq.sid)
                self.kv.discard(p.seq.sid)
                outcomes.append(StepOutcome(p, error=_internal(exc, p)))
        return StepDone(outcomes, [])

    # ------------------------------------------------------------------ back on the loop thread
    def _deliver(self, o: StepOutcome, seconds: float) -> RoundResult | None:
        """One outcome to its session: the committed sequence grows, then `on_result` runs."""
        p, s = o.planned, o.planned.seq
        if s.status is SeqStatus.CLOSING:
            self._release(s)
            return None
        if o.result is None and o.error is None:
            s.move(SeqStatus.READY)  # a prefill chunk: the round waits for the next step
            return None
        s.job = None
        result = o.result
        if o.error is not None:
            self.kv.discard(s.sid)
            result = RoundResult(
                p.job.round, [], [], False, len(s.committed), seconds * 1e3, True, "error", error=o.error
            )
        assert result is not None
        result.round_s = time.perf_counter() - p.job.ready_at
        s.committed.extend(result.tokens)
        if result.done or s.cancelled:
            s.move(SeqStatus.IDLE)
            self._settle(s)
        else:
            s.move(SeqStatus.WAITING)
        s.on_result(result)
        return result

    def _settle(self, s: SeqState) -> None:
        """`s`'s generation is over: its KV reservation goes, and the generations waiting for room
        that now fit are admitted (their prompt round becomes READY)."""
        self.room.release(s.sid)
        for sid in self.room.admit_waiting():
            q = self.seqs[sid]
            assert q.job is not None
            q.job = Job(q.job.round, q.job.tree)  # ready from now (round_s counts from here)
            q.move(SeqStatus.READY)

    def _unrun(self, s: SeqState) -> None:
        if s.status is SeqStatus.CLOSING:
            self._release(s)
        else:
            s.move(SeqStatus.READY)

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
        s.job = None
        if s.status is SeqStatus.RUNNING:
            s.move(SeqStatus.CLOSING)
        elif s.status is not SeqStatus.CLOSING:
            self._release(s)

    def _release(self, s: SeqState) -> None:
        if s.status is not SeqStatus.CLOSED:
            s.move(SeqStatus.CLOSED)
        if self.seqs.pop(s.sid, None) is not None:
            self.kv.free(s.sid)
            self._settle(s)

    def start(self, s: SeqState, prompt: Prompt, committed: np.ndarray, *, ignore_eos: bool = False) -> None:
        """Begin a generation: committed = cached context (if continuing) + the new prompt tokens.
        `ignore_eos`: end-of-text ids do not end it (the prompt's own stop ids still do)."""
        mode = prompt.mode
        temp = 0.0 if mode is Mode.GREEDY else prompt.temperature
        s.params = SamplingParams(temperature=temp, top_k=prompt.top_k, top_p=prompt.top_p)
        s.mode = mode
        s.seed = prompt.seed
        s.generator = torch.Generator(device=self.target.device).manual_seed(prompt.seed)
        new = [int(t) for t in committed]
        cached = self.kv.cached_len(s.sid)
        if cached:
            # keep the cache of the longest prefix the new sequence shares with the cached one (a
            # continued conversation: all of it; a resumed session: what it had committed), short
            # of the new sequence's last token, which the forward feeds
            keep = common_prefix(new, s.committed, min(cached, len(new) - 1))
            if keep == 0:
                self.kv.free(s.sid)
                self.kv.add(s.sid)
            elif keep < cached:
                self.kv.truncate(s.sid, keep)
        s.committed = new
        s.prompt_len = len(new)
        s.max_new_tokens = prompt.max_new_tokens
        s.stop_ids = (frozenset() if ignore_eos else self.eos_ids) | frozenset(prompt.stop_ids)
        s.cancelled = False
        nodes = prompt.tree.num_nodes if prompt.tree is not None else 0
        rows = 0 if mode is Mode.AR else max(self.config.max_nodes, nodes)
        worst = worst_positions(len(new), s.max_new_tokens, self.config.max_context, rows)
        if self.room.request(s.sid, worst, first=len(new) + nodes):
            self.submit(s, 0, prompt.tree)
        else:  # no room in the pool yet: the prompt waits, unprefilled, until _settle admits it
            s.move(SeqStatus.QUEUED)
            s.job = Job(0, prompt.tree)

    def end(self, s: SeqState) -> None:
        """The session's generation ended outside the engine (a cancel with no round in flight)."""
        if s.status is SeqStatus.WAITING:
            s.move(SeqStatus.IDLE)
            self._settle(s)
        elif s.status in (SeqStatus.QUEUED, SeqStatus.READY, SeqStatus.RUNNING):
            s.cancelled = True  # the queued round still runs; the session is IDLE after it

    def submit(self, s: SeqState, round_id: int, tree: TokenTree | None) -> bool:
        """Queue a round; False when the session is closed (the round is dropped)."""
        if s.status in (SeqStatus.CLOSING, SeqStatus.CLOSED):
            return False
        s.move(SeqStatus.READY)
        s.job = Job(round_id, tree)
        return True

    @property
    def ready(self) -> int:
        """Rounds queued and not in the step now running."""
        return sum(1 for s in self.seqs.values() if s.status is SeqStatus.READY)

    @property
    def queued(self) -> int:
        """Generations waiting for room in the KV pool."""
        return self.room.queued


def common_prefix(a: Sequence[int], b: Sequence[int], most: int) -> int:
    """How many leading tokens `a` and `b` share, at most `most`."""
    n = min(len(a), len(b), most)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return max(n, 0)


# ---------------------------------------------------------------------------- what a step packs
def plan_step(seqs: Iterable[SeqState], kv: PagedKVCache, config: EngineConfig, rr: int) -> list[Planned]:
    """The step's rounds, in forward order (Orca-style iteration-level scheduling): every session's
    ready round, up to the token budget, rounds that feed one committed row (decode steps, trees)
    first and prefills after them, a long prefill chunked (at most prefill_chunk rows a step while
    others wait; it keeps its row 0 and tree for a later step), a tree round never split.
    rr: the round-robin counter (which ready session, in session-id order, goes first among
    equals)."""
    ready = [s for s in seqs if s.status is SeqStatus.READY]
    if not ready:
        return []
    ready.sort(key=lambda s: s.sid)
    start = rr % len(ready)
    ready = ready[start:] + ready[:start]
    # rounds that feed one committed row (decode steps, trees) go first, prefills after them; and
    # while others wait, a prefill feeds at most prefill_chunk rows a step, so a long prompt
    # cannot stretch every other session's step (they would wait for its whole chunk)
    fresh = {s.sid: len(s.committed) - kv.cached_len(s.sid) for s in ready}
    ready.sort(key=lambda s: fresh[s.sid] > 1)
    chunk = config.token_budget if len(ready) == 1 else config.prefill_chunk
    budget = config.token_budget
    plan: list[Planned] = []
    for s in ready:
        assert s.job is not None
        pre = s.committed[kv.cached_len(s.sid) :]
        nodes = s.job.tree.num_nodes if s.job.tree is not None else 0
        if len(pre) + nodes <= min(budget, max(chunk, nodes + 1)):
            plan.append(Planned(s, s.job, pre, final=True))
            budget -= len(pre) + nodes
        elif len(pre) > 1 and budget > 0:
            # chunked prefill: feed committed tokens now, keep row 0 (+ tree) for a later step
            take = min(budget, chunk, len(pre) - 1)
            plan.append(Planned(s, s.job, pre[:take], final=False))
            budget -= take
        if budget <= 0 or not config.batching:
            break
    if not plan and ready:
        # a single round larger than the budget with nothing to chunk: run it alone
        s = ready[0]
        assert s.job is not None
        plan.append(Planned(s, s.job, s.committed[kv.cached_len(s.sid) :], final=True))
    return plan


def _internal(exc: Exception, p: Planned) -> ProtocolError:
    return ProtocolError(ErrorCode.INTERNAL, f"verifier error: {exc}", None, fatal=True, round=p.job.round)


def _unpack(p: Planned, values: list[int]) -> tuple[list[int], list[int]]:
    """A verdict read back from the device: an `ar` step's [token], or a tree's packed verdict."""
    tree = p.job.tree if p.final else None
    if tree is None or tree.num_nodes == 0:
        return [int(values[0])], []
    res = unpack_verdict(values, tree)
    return list(res.tokens), list(res.accepted_nodes)


__all__ = [
    "TRANSITIONS",
    "EngineConfig",
    "IllegalTransition",
    "Job",
    "Packed",
    "Planned",
    "RoundResult",
    "SeqState",
    "SeqStatus",
    "StepDone",
    "StepOutcome",
    "StepRunner",
    "StepVerdict",
    "plan_step",
]
