"""The engine on the tiny model, without a server: what one step packs (planning, the token
budget, prefill chunking), chunked prefill against an unchunked run, the KV-full path and stop cuts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from cloud_verifier.engine import Engine
from cloud_verifier.step import EngineConfig, Planned, RoundResult, SeqState, plan_step
from shared.errors import ErrorCode
from shared.messages import Mode, Prompt
from shared.tree import TokenTree
from tests.cloud_verifier.service import prompt_tokens, reference, tiny


def _engine(**cfg: Any) -> Engine:
    t = tiny()
    return Engine(t, t.new_kv_cache(256, 16), EngineConfig(**cfg))


def _plan(e: Engine) -> list[Planned]:
    """What the next step would pack (planning only: nothing is marked running)."""
    return plan_step(e.seqs.values(), e.kv, e.config, 0)


def _start(e: Engine, n_prompt: int, seed: int) -> SeqState:
    s = e.open(lambda r: None)
    toks = np.asarray(prompt_tokens(seed, n_prompt), dtype=np.int32)
    e.start(s, Prompt(toks, Mode.GREEDY, max_new_tokens=8), toks)
    return s


def test_a_long_prefill_is_chunked_small_while_others_wait() -> None:
    async def main() -> None:
        e = _engine(token_budget=512, prefill_chunk=32)
        long = _start(e, 400, 1)
        plan = _plan(e)
        # alone, a prompt takes the whole budget: all 400 rows, row 0 included, in one step
        assert [(p.seq.sid, len(p.pre), p.final) for p in plan] == [(long.sid, 400, True)]
        short = _start(e, 1, 2)  # a one-row round (like a decode step) joins
        plan = _plan(e)
        # the one-row round goes first and whole; the prefill takes at most prefill_chunk rows
        assert plan[0].seq is short and plan[0].final and len(plan[0].pre) == 1
        assert plan[1].seq is long and not plan[1].final and len(plan[1].pre) == 32

    asyncio.run(main())


def test_a_tree_round_is_never_split() -> None:
    async def main() -> None:
        e = _engine(token_budget=512, prefill_chunk=8)
        s = e.open(lambda r: None)
        toks = np.asarray(prompt_tokens(3, 1), dtype=np.int32)
        tree = TokenTree.chain(list(range(100, 120)), base=1)
        e.start(s, Prompt(toks, Mode.GREEDY, max_new_tokens=8, tree=tree), toks)
        _start(e, 100, 4)
        plan = _plan(e)
        mine = next(p for p in plan if p.seq is s)
        # row 0 and all 20 nodes in one step, though that is more rows than prefill_chunk
        assert mine.final and len(mine.pre) == 1 and plan[0] is mine

    asyncio.run(main())


# --------------------------------------------------------------------------- running the loop
def _run(
    e: Engine, prompts: list[tuple[list[int], Prompt]], timeout_s: float = 60.0
) -> tuple[list[list[RoundResult]], list[tuple[int, int]]]:
    """Run the engine's loop until every generation ends; each session asks for its next single
    step (no tree) after every verdict. Returns each session's results and every step's (rows,
    sessions)."""
    results: list[list[RoundResult]] = [[] for _ in prompts]
    steps: list[tuple[int, int]] = []

    async def main() -> None:
        done = asyncio.Event()
        left = len(prompts)
        e.on_step = lambda rows, sessions, _s: steps.append((rows, sessions))
        e.start_loop()

        def on_result(i: int, s: SeqState) -> Callable[[RoundResult], None]:
            def cb(r: RoundResult) -> None:
                nonlocal left
                results[i].append(r)
                if r.done:
                    left -= 1
                    if left == 0:
                        done.set()
                else:
                    e.submit(s, r.round + 1, None)

            return cb

        seqs = []
        for i in range(len(prompts)):
            s = e.open(lambda r: None)
            s.on_result = on_result(i, s)
            seqs.append(s)
        for s, (toks, prompt) in zip(seqs, prompts, strict=True):
            e.start(s, prompt, np.asarray(toks, dtype=np.int32))
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        finally:
            await e.stop()

    asyncio.run(main())
    return results, steps


def _tokens(results: list[RoundResult]) -> list[int]:
    return [t for r in results for t in r.tokens]


def test_step_planning_packs_one_row_rounds_first_within_the_token_budget() -> None:
    async def main() -> None:
        e = _engine(token_budget=40, prefill_chunk=16)
        prefill = _start(e, 30, 10)
        decodes = [_start(e, 1, 20 + i) for i in range(5)]
        plan = _plan(e)
        # the five one-row rounds first, then the prefill gets what is left of the budget (35 rows,
        # capped at prefill_chunk) and keeps its row 0 for a later step
        assert [p.seq for p in plan[:5]] == sorted(decodes, key=lambda s: s.sid)
        assert all(p.final and len(p.pre) == 1 for p in plan[:5])
        assert plan[5].seq is prefill and not plan[5].final and len(plan[5].pre) == 16
        assert sum(len(p.pre) for p in plan) <= 40
        # a budget smaller than the one-row rounds: the step stops when it is spent
        e.config = EngineConfig(token_budget=3, prefill_chunk=16)
        assert [len(p.pre) for p in _plan(e)] == [1, 1, 1]
        # without batching: one session per step
        e.config = EngineConfig(token_budget=512, prefill_chunk=16, batching=False)
        assert len(_plan(e)) == 1

    asyncio.run(main())


def test_chunked_prefill_interleaves_and_gives_the_unchunked_tokens() -> None:
    long_prompt = prompt_tokens(31, 150)
    short_prompt = prompt_tokens(32, 4)
    want_long = reference(tuple(long_prompt), 6)
    want_short = reference(tuple(short_prompt), 12)
    e = _engine(token_budget=512, prefill_chunk=16, gather_ms=0)
    results, steps = _run(
        e,
        [
            (short_prompt, Prompt(np.asarray(short_prompt), Mode.GREEDY, max_new_tokens=12)),
            (long_prompt, Prompt(np.asarray(long_prompt), Mode.GREEDY, max_new_tokens=6)),
        ],
    )
    assert _tokens(results[0]) == want_short and _tokens(results[1]) == want_long
    # the long prompt was fed in chunks while the short session decoded: the first step packs the
    # short prompt (4 rows) and a 16-row chunk, the next eight a decode row and a chunk each, then a
    # decode row and the prompt's last 6 rows (row 0 included, verified)
    two = [rows for rows, sessions in steps if sessions == 2]
    assert two[:10] == [4 + 16] + [1 + 16] * 8 + [1 + 6]
    # the same prompt alone takes its whole budget in one step and gives the same tokens
    alone, alone_steps = _run(
        _engine(token_budget=512, prefill_chunk=16, gather_ms=0),
        [(long_prompt, Prompt(np.asarray(long_prompt), Mode.GREEDY, max_new_tokens=6))],
    )
    assert _tokens(alone[0]) == want_long and alone_steps[0] == (150, 1)


def test_a_request_the_kv_pool_cannot_hold_fails_busy_alone_and_the_pool_is_intact() -> None:
    t = tiny()
    e = Engine(t, t.new_kv_cache(8, 16), EngineConfig(gather_ms=0))  # 128 slots
    free = e.kv.num_free_blocks
    small = prompt_tokens(41, 5)
    huge = prompt_tokens(42, 300)
    results, _ = _run(
        e,
        [
            (small, Prompt(np.asarray(small), Mode.GREEDY, max_new_tokens=10)),
            (huge, Prompt(np.asarray(huge), Mode.GREEDY, max_new_tokens=4)),
        ],
    )
    (err,) = results[1]
    assert err.error is not None and err.error.code is ErrorCode.BUSY and err.tokens == []
    assert "KV cache is full" in err.error.message and err.done
    assert _tokens(results[0]) == reference(tuple(small), 10)  # the other session lost nothing
    for s in list(e.seqs.values()):
        e.close(s)
    assert e.kv.num_free_blocks == free and e.kv.sequences() == []


def test_a_stop_token_cuts_the_verdict_exactly_there() -> None:
    prompt = prompt_tokens(51, 6)
    ref = reference(tuple(prompt), 10)
    cut = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])  # first fresh token past 2
    tree = TokenTree.chain(ref[:9], base=len(prompt) - 1, cond=[prompt[-1]])
    # the tree holds the whole greedy path: without a stop, all 9 nodes and the bonus are emitted
    full, _ = _run(
        _engine(gather_ms=0),
        [(prompt, Prompt(np.asarray(prompt), Mode.GREEDY, max_new_tokens=10, tree=tree))],
    )
    assert full[0][0].tokens == ref[:10] and full[0][0].accepted_nodes == list(range(9))
    e = _engine(gather_ms=0)
    results, _ = _run(
        e,
        [
            (
                prompt,
                Prompt(np.asarray(prompt), Mode.GREEDY, max_new_tokens=10, tree=tree, stop_ids=(ref[cut],)),
            )
        ],
    )
    (r,) = results[0]
    assert r.tokens == ref[: cut + 1] and r.done and r.reason == "stop"
    assert r.accepted_nodes == list(range(cut + 1)) and not r.has_bonus
    assert r.committed_len == len(prompt) + cut + 1
    (s,) = e.seqs.values()
    assert s.committed == prompt + ref[: cut + 1] and e.kv.cached_len(s.sid) == len(s.committed) - 1
