"""What one engine step packs (Orca-style iteration-level scheduling): every session's ready round,
up to the token budget, rounds that feed one committed row (decode steps, trees) first and
prefills after them, a long prefill chunked (at most prefill_chunk rows a step while others wait;
it keeps its row 0 and tree for a later step), a tree round never split."""

from __future__ import annotations

from collections.abc import Iterable

from cloud_verifier.engine_state import EngineConfig, Planned, SeqState, SeqStatus
from shared.model.kv_cache import PagedKVCache


def plan_step(seqs: Iterable[SeqState], kv: PagedKVCache, config: EngineConfig, rr: int) -> list[Planned]:
    """The step's rounds, in forward order. rr: the round-robin counter (which ready session, in
    session-id order, goes first among equals)."""
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
