"""The service driven past its KV pool (tiny model, a pool of a few blocks): more concurrent OpenAI
streams and WebSocket sessions than the pool holds at once all complete with exactly the tokens
each gives alone; generations wait for room, and a round that outgrows its reservation preempts a
later session, which is recomputed. /metrics counts the preemptions and shows the pool."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import httpx
import numpy as np

from shared.messages import Mode, Prompt, Stale, Tree, Verdict, Welcome
from shared.tree import TokenTree
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    prompt_tokens,
    reference,
    run_greedy_async,
)


def _metric(text: str, name: str) -> float:
    (value,) = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return value


async def _stream(client: httpx.AsyncClient, prompt: list[int], n: int) -> list[int]:
    """One streamed greedy /v1/completions request; the token ids it streamed (an error event fails)."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "return_token_ids": True}
    ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            assert "error" not in doc, doc
            for choice in doc["choices"]:
                ids += choice.get("token_ids", [])
    return ids


def test_openai_streams_past_the_kv_pool_all_complete_exactly() -> None:
    """Five concurrent streams, each reserving 4 of the pool's 9 blocks (20 prompt tokens + 32): two
    run at a time, the rest wait for room. Each streams the target's own greedy tokens; before,
    the pool filled and streams died mid-way ("the verifier's KV cache is full")."""
    prompts = [prompt_tokens(200 + i, 20) for i in range(5)]
    with LiveServer(kv_blocks=9, block_size=16, max_sessions=8) as srv:

        async def main() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=srv.http, timeout=120) as client:
                return list(await asyncio.gather(*(_stream(client, p, 32) for p in prompts)))

        got = asyncio.run(main())
        metrics = httpx.get(srv.http + "/metrics").text
    assert got == [reference(tuple(p), 32) for p in prompts]
    # exact reservations: no preemption, and nothing left reserved or queued
    assert _metric(metrics, "cloud_verifier_preemptions_total") == 0
    assert _metric(metrics, "cloud_verifier_kv_blocks_reserved") == 0
    assert _metric(metrics, "cloud_verifier_kv_queued_generations") == 0
    assert _metric(metrics, "specdec_kv_blocks_total") == 9


def test_websocket_sessions_past_the_kv_pool_all_complete_exactly() -> None:
    """Four speculative sessions, each reserving 3 of the pool's 7 blocks (12 prompt tokens + 30 +
    a 4-node tree): two prompts wait before their prefill; every session's greedy output is the
    target's."""
    prompts = [prompt_tokens(300 + i, 12) for i in range(4)]
    with LiveServer(kv_blocks=7, block_size=16, max_nodes=4) as srv:

        async def one(i: int) -> list[int]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            out = await run_greedy_async(s, prompts[i], 30, seed=i, nodes=4)
            await s.close()
            return out

        async def main() -> list[list[int]]:
            return list(await asyncio.gather(*(one(i) for i in range(4))))

        got = asyncio.run(main())
    assert got == [reference(tuple(p), 30) for p in prompts]


def _tree(rng: random.Random, committed: list[int], ref: list[int], nodes: int) -> TokenTree:
    """A tree of exactly `nodes` nodes: the reference for a few tokens, then a wrong one, and a
    branch of random tokens."""
    ahead = ref[len(committed) :]
    good = ahead[: rng.randint(0, len(ahead) - 1)]
    chain = [*good, ahead[len(good)] ^ 1]
    other = [rng.randrange(3, 49152) for _ in range(nodes - len(chain))]
    return TokenTree.from_sequences([chain, other], base=len(committed))


async def _verdict(s: AsyncSession) -> Verdict:
    while True:
        msg = await s.recv()
        if not isinstance(msg, Stale):
            assert isinstance(msg, Verdict), msg
            return msg


def test_a_session_preempted_mid_generation_is_recomputed_and_its_output_is_unchanged() -> None:
    """The engine reserves no tree rows here, so trees outgrow the reservations: two 44-token prompts
    that may add 4 tokens reserve 3 blocks each and fill the pool of 6 once prefilled. The first
    8-node tree needs a fourth block: the earlier-admitted session's round frees the other's blocks,
    which is prefilled again from its committed tokens when there is room. Both emit the target's
    greedy tokens, and /metrics counts the preemption."""
    prompts = [prompt_tokens(400 + i, 44) for i in range(2)]
    refs = [p + reference(tuple(p), 4) for p in prompts]
    with LiveServer(kv_blocks=6, block_size=16, max_nodes=8) as srv:
        srv.engine.config = dataclasses.replace(srv.engine.config, max_nodes=0)

        async def main() -> list[list[int]]:
            sessions = [await AsyncSession.open(srv.ws) for _ in prompts]
            for s, p in zip(sessions, prompts, strict=True):
                assert isinstance(await s.recv(), Welcome)
                await s.ws.send(s.proto.prompt(Prompt(np.array(p), Mode.GREEDY, max_new_tokens=4)))
            # both prompts prefilled (one token each, a round without a tree): the pool is full
            outs: list[list[int]] = [(await _verdict(s)).tokens.tolist() for s in sessions]

            async def rest(i: int, s: AsyncSession) -> list[int]:
                rng, out = random.Random(i), outs[i]
                while len(out) < 4:
                    s.round += 1
                    tree = _tree(rng, list(s.proto.committed), refs[i], 8)
                    await s.ws.send(s.proto.tree(Tree(s.round, tree)))
                    v = await _verdict(s)
                    out = out + [int(t) for t in v.tokens]
                    if v.done:
                        break
                await s.close()
                return out

            return list(await asyncio.gather(*(rest(i, s) for i, s in enumerate(sessions))))

        got = asyncio.run(main())
        metrics = httpx.get(srv.http + "/metrics").text
    assert got == [ref[len(p) :] for p, ref in zip(prompts, refs, strict=True)]
    assert _metric(metrics, "cloud_verifier_preemptions_total") >= 1
    assert _metric(metrics, "cloud_verifier_kv_blocks_reserved") == 0
