"""The engine step without asyncio (cloud_verifier/step.py): StepRunner.step drives whole generations
on the tiny model and gives the target's own tokens; every session's status walks only the allowed
transitions; a session closed during its step, a KV-full deferral, a prefill chunk and a cancel
each leave the status the engine's rules say."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from cloud_verifier.step import (
    TRANSITIONS,
    EngineConfig,
    IllegalTransition,
    RoundResult,
    SeqState,
    SeqStatus,
    StepRunner,
)
from shared.messages import Mode, Prompt
from shared.tree import TokenTree
from tests.cloud_verifier.service import prompt_tokens, reference, tiny


def _status(s: SeqState) -> SeqStatus:
    """Read through a call, so the type checker does not carry an earlier assert's narrowing."""
    return s.status


def _runner(blocks: int = 256, **cfg: int) -> StepRunner:
    t = tiny()
    return StepRunner(t, t.new_kv_cache(blocks, 16), EngineConfig(**cfg))  # type: ignore[arg-type]


def _prompt(tokens: list[int], n: int, tree: TokenTree | None = None) -> Prompt:
    return Prompt(np.asarray(tokens, dtype=np.int32), Mode.GREEDY, max_new_tokens=n, tree=tree)


def _generate(
    r: StepRunner, prompts: list[list[int]], n: int
) -> tuple[list[list[int]], list[list[SeqStatus]]]:
    """Run every prompt to its end with `ar` steps, one `step()` at a time; each session's tokens
    and the statuses it was seen in between steps."""
    tokens: list[list[int]] = [[] for _ in prompts]
    seen: list[list[SeqStatus]] = [[] for _ in prompts]
    seqs: list[SeqState] = []

    def on_result(i: int) -> Callable[[RoundResult], None]:
        def cb(res: RoundResult) -> None:
            tokens[i].extend(res.tokens)
            if not res.done:
                r.submit(seqs[i], res.round + 1, None)

        return cb

    for i, p in enumerate(prompts):
        s = r.open(on_result(i))
        seqs.append(s)
        r.start(s, _prompt(p, n), np.asarray(p, dtype=np.int32))
    for _ in range(10 * n):
        if not r.step():
            break
        for i, s in enumerate(seqs):
            seen[i].append(s.status)
    return tokens, seen


def test_the_step_runner_alone_gives_the_targets_greedy_tokens() -> None:
    prompts = [prompt_tokens(61, 5), prompt_tokens(62, 9), prompt_tokens(63, 3)]
    r = _runner(gather_ms=0)
    tokens, seen = _generate(r, prompts, 7)
    assert tokens == [reference(tuple(p), 7) for p in prompts]
    # between steps a session is READY (its next round queued) until it ends IDLE
    for statuses in seen:
        assert statuses[-1] is SeqStatus.IDLE
        assert set(statuses) <= {SeqStatus.READY, SeqStatus.IDLE}
    assert r.forwards >= 7 and r.ready == 0


def test_a_tree_round_is_verified_and_committed_by_one_step() -> None:
    prompt = prompt_tokens(64, 6)
    ref = reference(tuple(prompt), 6)
    tree = TokenTree.chain([*ref[:4], ref[4] ^ 1], base=len(prompt) - 1, cond=[prompt[-1]])
    r = _runner()
    got: list[RoundResult] = []
    s = r.open(got.append)
    r.start(s, _prompt(prompt, 10, tree), np.asarray(prompt, dtype=np.int32))
    (res,) = r.step()
    assert got == [res]
    assert res.tokens == ref[:5] and res.accepted_nodes == [0, 1, 2, 3] and res.has_bonus
    assert _status(s) is SeqStatus.WAITING and s.committed == prompt + ref[:5]
    assert r.kv.cached_len(s.sid) == len(s.committed) - 1


def test_the_transition_table_is_enforced() -> None:
    s = SeqState(sid=1, on_result=lambda r: None)
    assert _status(s) is SeqStatus.IDLE
    with pytest.raises(IllegalTransition, match="idle -> running"):
        s.move(SeqStatus.RUNNING)
    for frm, allowed in TRANSITIONS.items():
        for to in SeqStatus:
            s.status = frm
            if to in allowed:
                s.move(to)
                assert s.status is to
            else:
                with pytest.raises(IllegalTransition):
                    s.move(to)
    assert TRANSITIONS[SeqStatus.CLOSED] == frozenset()


def test_a_session_closed_during_its_step_is_released_after_it() -> None:
    r = _runner()
    a = r.open(lambda res: None)
    b = r.open(lambda res: None)
    for s, seed in ((a, 65), (b, 66)):
        p = prompt_tokens(seed, 4)
        r.start(s, _prompt(p, 5), np.asarray(p, dtype=np.int32))
    plan = r.plan()
    assert {p.seq.status for p in plan} == {SeqStatus.RUNNING}
    r.close(a)  # the loop thread closes it while the worker runs the step
    assert _status(a) is SeqStatus.CLOSING and a.sid in r.seqs
    results = r.finish(r.execute(plan), 0.01)
    assert _status(a) is SeqStatus.CLOSED and a.sid not in r.seqs and a.sid not in r.kv.sequences()
    assert len(results) == 1 and b.status is SeqStatus.WAITING
    assert not r.submit(a, 1, None)  # a closed session's round is dropped


def test_a_kv_full_step_defers_rounds_on_the_loop_thread() -> None:
    # 48 slots: a 30-row prompt fits; a 60-row one never does, so it is admitted at once (its step
    # refuses it) and packed beside the first, and that forward does not fit
    r = _runner(blocks=3, prefill_chunk=512)
    seqs = [r.open(lambda res: None) for _ in range(2)]
    for s, (seed, n) in zip(seqs, ((67, 30), (68, 60)), strict=True):
        p = prompt_tokens(seed, n)
        r.start(s, _prompt(p, 2), np.asarray(p, dtype=np.int32))
    plan = r.plan()
    assert len(plan) == 2
    done = r.execute(plan)
    (deferred,) = done.deferred
    # the worker left the deferred session's status alone; finish puts its round back
    assert _status(deferred.seq) is SeqStatus.RUNNING
    r.finish(done, 0.01)
    assert _status(deferred.seq) is SeqStatus.READY and deferred.seq.job is not None
    assert r.forwards == 1


def test_a_prefill_chunk_keeps_the_round_queued() -> None:
    r = _runner(token_budget=512, prefill_chunk=8)
    long = r.open(lambda res: None)
    short = r.open(lambda res: None)
    for s, (seed, n) in zip((long, short), ((69, 40), (70, 1)), strict=True):
        p = prompt_tokens(seed, n)
        r.start(s, _prompt(p, 3), np.asarray(p, dtype=np.int32))
    assert r.step()  # the short round's verdict; the long prompt fed 8 rows
    assert _status(long) is SeqStatus.READY and r.kv.cached_len(long.sid) == 8
    assert _status(short) is SeqStatus.WAITING


def test_a_cancel_between_rounds_ends_idle_and_one_with_a_round_queued_after_it() -> None:
    r = _runner()
    got: list[RoundResult] = []
    s = r.open(got.append)
    p = prompt_tokens(71, 4)
    r.start(s, _prompt(p, 8), np.asarray(p, dtype=np.int32))
    r.step()
    assert _status(s) is SeqStatus.WAITING
    r.end(s)
    assert _status(s) is SeqStatus.IDLE
    r.start(s, _prompt(p, 8), np.asarray(p, dtype=np.int32))  # a new generation
    r.end(s)  # a cancel while its round is queued: the round still runs
    assert _status(s) is SeqStatus.READY
    (res,) = r.step()
    assert not res.done and s.status is SeqStatus.IDLE and got[-1] is res
    r.start(s, _prompt(p, 8), np.asarray(p, dtype=np.int32))
    with pytest.raises(IllegalTransition, match="ready -> ready"):
        r.submit(s, 1, None)  # one round in flight per session
