"""Room in the KV pool (cloud_verifier/kv_room.py): the bookkeeping alone on a pool with no model
(admission by worst case, a first-come-first-served queue, reclaiming idle blocks, preempting the
latest-admitted), then the step runner on the tiny model driving more generations than the pool
holds at once: every one completes with the target's own tokens, waiting or preempted, never refused."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import numpy as np

from cloud_verifier.engine import Engine
from cloud_verifier.kv_room import KVRoom, worst_positions
from cloud_verifier.step import EngineConfig, RoundResult, SeqState, SeqStatus, StepRunner
from shared.messages import Mode, Prompt
from shared.model.kv_cache import PagedKVCache
from shared.tree import TokenTree
from tests.cloud_verifier.service import prompt_tokens, reference, tiny


def _pool(blocks: int) -> PagedKVCache:
    return PagedKVCache(1, 1, 4, blocks, 4)  # 4 positions a block


def _hold(kv: PagedKVCache, sid: int, positions: int) -> None:
    """`sid` holds `positions` committed positions."""
    if sid not in kv.sequences():
        kv.add(sid)
    kv.reserve([(sid, positions)])
    kv.commit_rows(sid, list(range(positions)))


def test_worst_positions_is_the_longest_committed_sequence_and_a_round_past_it() -> None:
    assert worst_positions(10, 20, 4096, 8) == 38
    assert worst_positions(10, 5000, 100, 0) == 100  # max_context bounds the output
    assert worst_positions(10, 0, 4096, 0) == 11  # one token is always generated
    assert worst_positions(120, 50, 100, 4) == 125  # a prompt at the context still gets its token


def test_generations_are_admitted_by_worst_case_and_queued_first_come_first_served() -> None:
    room = KVRoom(_pool(10))
    assert room.request(1, positions=16, first=8)  # 4 blocks
    assert room.request(2, positions=20, first=8)  # 5 blocks: 9 of 10 reserved
    assert not room.request(3, positions=8, first=4)  # 2 blocks: waits
    assert not room.request(4, positions=4, first=4)  # 1 block would fit, but waits behind 3
    assert room.reserved_blocks == 9 and room.queued == 2
    room.release(1)
    assert room.admit_waiting() == [3, 4] and room.reserved == {2: 5, 3: 2, 4: 1}
    # a worst case over the whole pool reserves all of it: it runs when nothing else is admitted
    assert not room.request(5, positions=1000, first=8)
    for sid in (2, 3, 4):
        room.release(sid)
    assert room.admit_waiting() == [5] and room.reserved == {5: 10}
    # a prompt the pool cannot hold even empty is admitted at once, to be refused by its step
    assert room.request(6, positions=50, first=41) and room.reserved[6] == 0 and 6 in room.doomed
    room.release(6)
    assert 6 not in room.doomed and 6 not in room.order
    # a session that leaves the queue (its client went away) frees its place
    assert not room.request(7, positions=4, first=4)
    room.release(7)
    assert room.queued == 0


def test_fit_reclaims_idle_blocks_first_then_preempts_the_latest_admitted() -> None:
    kv = _pool(10)
    room = KVRoom(kv)
    for sid in (1, 2, 3):
        assert room.request(sid, positions=12, first=4)  # 3 blocks each
    _hold(kv, 9, 4)  # an idle session's cached context (no generation admitted): 1 block
    for sid in (1, 2, 3):
        _hold(kv, sid, 12)
    assert kv.num_free_blocks == 0
    # session 2's round outgrows its reservation by 2 blocks: the idle block goes, then session 3's
    runs, preempted = room.fit([(2, 8)])
    assert runs == {2} and preempted == [3] and room.preemptions == 1
    assert kv.cached_len(9) == 0 and kv.cached_len(3) == 0 and kv.cached_len(1) == 12
    # session 1 (admitted earlier) is never preempted for session 3: session 3's round waits
    _hold(kv, 2, 8)  # session 2's round committed its rows: 5 blocks, 2 free
    runs, preempted = room.fit([(3, 12)])
    assert runs == set() and preempted == [] and kv.cached_len(1) == 12
    # every round that fits runs, with no one preempted
    runs, preempted = room.fit([(3, 8)])
    assert runs == {3} and preempted == []


# ------------------------------------------------------------------------ the step runner, past the pool
def _drive(
    r: StepRunner, prompts: list[list[int]], n: int, tree_for: Callable[[SeqState], TokenTree | None]
) -> tuple[list[list[int]], list[RoundResult], set[SeqStatus]]:
    """Start every prompt at once and step until all end; after each verdict a session asks for its
    next round (`tree_for` its tree, None: an `ar` step). Each session's tokens, every result, and
    the statuses seen between steps."""
    tokens: list[list[int]] = [[] for _ in prompts]
    results: list[RoundResult] = []
    seen: set[SeqStatus] = set()
    seqs: list[SeqState] = []

    def on_result(i: int) -> Callable[[RoundResult], None]:
        def cb(res: RoundResult) -> None:
            tokens[i].extend(res.tokens)
            results.append(res)
            if not res.done:
                r.submit(seqs[i], res.round + 1, tree_for(seqs[i]))

        return cb

    for i, p in enumerate(prompts):
        s = r.open(on_result(i))
        seqs.append(s)
        r.start(s, Prompt(np.asarray(p, np.int32), Mode.GREEDY, max_new_tokens=n), np.asarray(p, np.int32))
    for _ in range(50 * n):
        seen |= {s.status for s in seqs}
        if all(s.status is SeqStatus.IDLE for s in seqs):
            break
        r.step()
    return tokens, results, seen


def test_generations_past_the_pool_wait_for_room_and_give_the_targets_tokens() -> None:
    """Five generations, each reserving 4 of the pool's 9 blocks (20 prompt tokens + 30): two run at
    a time, the others wait unprefilled and start as the first end. Without the reservations the
    pool filled and a round that found no free block was refused (BUSY)."""
    prompts = [prompt_tokens(80 + i, 20) for i in range(5)]
    t = tiny()
    r = StepRunner(t, t.new_kv_cache(9, 16), EngineConfig(gather_ms=0, max_nodes=0))
    tokens, results, seen = _drive(r, prompts, 30, lambda s: None)
    assert [res.error for res in results if res.error is not None] == []
    assert tokens == [reference(tuple(p), 30) for p in prompts]
    assert SeqStatus.QUEUED in seen and r.room.preemptions == 0  # exact reservations: no preemption
    assert r.room.reserved_blocks == 0 and r.queued == 0


def test_rounds_that_outgrow_their_reservation_preempt_and_recompute_exactly() -> None:
    """An engine that reserves no tree rows, so trees outgrow the reservations: four 44-token prompts
    that may add 4 tokens reserve 3 blocks each, three fit the pool's 9 and fill it once prefilled.
    Their first trees (12 nodes) each need a fourth block: the earliest-admitted session's round
    frees the latest's blocks, which is prefilled again from its committed tokens later. Every
    session emits the target's greedy tokens."""
    prompts = [prompt_tokens(90 + i, 44) for i in range(4)]
    refs = [p + reference(tuple(p), 4) for p in prompts]
    rng = random.Random(5)

    def tree_for(s: SeqState) -> TokenTree:
        i = next(k for k, p in enumerate(prompts) if s.committed[: len(p)] == p)
        ahead = refs[i][len(s.committed) :]
        good = ahead[: rng.randint(0, len(ahead) - 1)]
        chain = [*good, ahead[len(good)] ^ 1]  # the reference for a while, then a wrong token
        wrong = [rng.randrange(3, 49152) for _ in range(12 - len(chain))]
        return TokenTree.from_sequences([chain, wrong], base=len(s.committed))

    t = tiny()
    r = StepRunner(t, t.new_kv_cache(9, 16), EngineConfig(gather_ms=0, max_nodes=0))
    tokens, results, seen = _drive(r, prompts, 4, tree_for)
    assert [res.error for res in results if res.error is not None] == []
    assert tokens == [ref[len(p) :] for p, ref in zip(prompts, refs, strict=True)]
    assert r.room.preemptions >= 1 and SeqStatus.QUEUED in seen


def _status(s: SeqState) -> SeqStatus:
    """Read through a call, so the type checker does not carry an earlier assert's narrowing."""
    return s.status


def test_a_queued_generation_closed_or_cancelled_leaves_the_queue_as_the_protocol_expects() -> None:
    """Closed while waiting, a generation's place goes to the next; cancelled while waiting, its
    prompt round still runs once admitted (the client waits for that verdict), and it ends IDLE."""
    prompts = [prompt_tokens(110 + i, 20) for i in range(4)]
    t = tiny()
    r = StepRunner(t, t.new_kv_cache(9, 16), EngineConfig(gather_ms=0, max_nodes=0))
    got: list[list[RoundResult]] = [[] for _ in prompts]
    seqs = [r.open(got[i].append) for i in range(4)]
    for s, p in zip(seqs, prompts, strict=True):
        r.start(s, Prompt(np.asarray(p, np.int32), Mode.GREEDY, max_new_tokens=30), np.asarray(p, np.int32))
    a, b, c, d = seqs
    assert [s.status for s in seqs] == [SeqStatus.READY] * 2 + [SeqStatus.QUEUED] * 2
    assert c.working and d.working  # not idle: the reader keeps waiting for them
    r.close(c)
    assert _status(c) is SeqStatus.CLOSED and [sid for sid, _ in r.room.queue] == [d.sid]
    r.end(d)
    assert _status(d) is SeqStatus.QUEUED and d.cancelled
    for _ in range(10):  # a's and b's prompt rounds (no next round is asked for)
        if _status(a) is SeqStatus.WAITING and _status(b) is SeqStatus.WAITING:
            break
        r.step()
    assert _status(d) is SeqStatus.QUEUED  # a and b still hold their reservations
    r.end(a)  # a's generation is cancelled between rounds: its room goes to d
    assert _status(d) is SeqStatus.READY
    r.step()
    assert _status(d) is SeqStatus.IDLE and [len(x) for x in got] == [1, 1, 0, 1]
    assert got[3][0].tokens == reference(tuple(prompts[3]), 1)
    assert r.room.queued == 0 and set(r.room.reserved) == {b.sid}


def test_an_engine_whose_ready_round_waits_for_room_is_healthy_and_runs_it_when_room_frees() -> None:
    """Two sessions fill the pool; the later-admitted one's tree outgrows its reservation (an
    engine that reserves no tree rows) while the earlier one's client drafts: its round waits for
    room, which is not a stalled loop, past stall_s. The earlier session's next tree preempts it,
    and both end with the target's tokens."""
    prompts = [prompt_tokens(120 + i, 44) for i in range(2)]
    refs = [reference(tuple(p), 4) for p in prompts]
    t = tiny()
    e = Engine(t, t.new_kv_cache(6, 16), EngineConfig(gather_ms=0, max_nodes=0, stall_s=0.2))
    tree = TokenTree.from_sequences([[5, *range(100, 111)]], base=45)  # 12 nodes; 5 is wrong

    async def main() -> tuple[bool, list[list[int]]]:
        got: list[asyncio.Queue[RoundResult]] = [asyncio.Queue(), asyncio.Queue()]
        seqs = [e.open(got[i].put_nowait) for i in range(2)]
        e.start_loop()
        for s, p in zip(seqs, prompts, strict=True):
            toks = np.asarray(p, np.int32)
            e.start(s, Prompt(toks, Mode.GREEDY, max_new_tokens=4), toks)
        out = [(await asyncio.wait_for(q.get(), 30)).tokens for q in got]  # both prefilled: pool full
        e.submit(seqs[1], 1, tree)
        await asyncio.sleep(0.5)  # past stall_s with the round waiting for room, no step running
        healthy = e.healthy() and e.runner.waiting_for_room
        e.submit(seqs[0], 1, tree)
        for i, s in enumerate(seqs):
            while True:
                r = await asyncio.wait_for(got[i].get(), 30)
                out[i] = out[i] + r.tokens
                if r.done:
                    break
                e.submit(s, r.round + 1, TokenTree.from_sequences([[5]], base=len(s.committed)))
        await e.stop()
        return healthy, out

    healthy, out = asyncio.run(main())
    assert healthy and out == refs and e.preemptions == 1
