"""The engine's planning on the tiny model, without a server: what one step packs."""

from __future__ import annotations

import asyncio

import numpy as np

from cloud_verifier.engine import Engine, EngineConfig
from shared.messages import Mode, Prompt
from shared.tree import TokenTree
from tests.cloud_verifier.service import prompt_tokens, tiny


def _engine(**cfg: int) -> Engine:
    t = tiny()
    return Engine(t, t.new_kv_cache(256, 16), EngineConfig(**cfg))  # type: ignore[arg-type]


def _start(e: Engine, n_prompt: int, seed: int) -> object:
    s = e.open(lambda r: None)
    toks = np.asarray(prompt_tokens(seed, n_prompt), dtype=np.int32)
    e.start(s, Prompt(toks, Mode.GREEDY, max_new_tokens=8), toks)
    return s


def test_a_long_prefill_is_chunked_small_while_others_wait() -> None:
    async def main() -> None:
        e = _engine(token_budget=512, prefill_chunk=32)
        long = _start(e, 400, 1)
        plan = e._plan()
        # alone, a prompt takes the whole budget: all 400 rows, row 0 included, in one step
        assert [(p.seq.sid, len(p.pre), p.final) for p in plan] == [(long.sid, 400, True)]  # type: ignore[attr-defined]
        short = _start(e, 1, 2)  # a one-row round (like a decode step) joins
        for p in plan:
            p.seq.busy = False
        plan = e._plan()
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
        plan = e._plan()
        mine = next(p for p in plan if p.seq is s)
        # row 0 and all 20 nodes in one step, though that is more rows than prefill_chunk
        assert mine.final and len(mine.pre) == 1 and plan[0] is mine

    asyncio.run(main())
