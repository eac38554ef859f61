"""Mode auto against the real service: streaming and speculation switch round by round, and the
output stays exactly the target's (greedy: its own decoding; seeded match: seeded `ar`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.harness import load_prompts
from edge_client.client import EdgeClient
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from edge_client.speculation.auto import (
    Option,
    Plan,
    Realized,
    choose,
    fallback_pays,
    price_speculation,
    price_stream,
)
from edge_client.stats import GenerationStats
from shared.model import load_target
from tests.cloud_verifier.service import LiveServer, tiny
from tests.edge_client.test_e2e import boundary_distance, greedy_with_gaps

CPU = {0: 69.0, 1: 125.0, 2: 128.0, 4: 84.0, 8: 132.0, 16: 252.0}  # a 2-core CPU's forward, ms
GPU = {0: 16.0, 1: 16.0, 4: 16.0, 16: 16.5, 64: 17.0}  # a GPU's: rows are nearly free


async def _run(
    url: str, drafter: Drafter | None, prompt: str, **kw: Any
) -> tuple[list[int], list[int], GenerationStats]:
    """(prompt tokens, output tokens, stats) of one generation."""
    async with EdgeClient(url, drafter) as c:
        async for _ in c.generate(prompt, **kw):
            pass
        assert c.last is not None
        return c.last.prompt_tokens, c.last.tokens, c.last.stats


def test_the_plan_streams_where_speculation_cannot_pay_and_speculates_where_it_does() -> None:
    stream = price_stream(GPU, GPU)
    # a GPU verifier and a slow edge: drafting a chain of 3 (3 x 19 ms) and a 50 ms round trip
    spec = price_speculation(2.8, 3, 57.0, 50.0, 0.5, GPU, GPU)
    assert choose(Plan(), spec, stream).kind == "stream"
    # this CPU: a chain of 3 verifies in 84 ms for 2.8 tokens against 69 ms a streamed token
    spec = price_speculation(2.8, 3, 57.0, 0.0, 0.5, CPU, CPU)
    assert choose(Plan(), spec, price_stream(CPU, CPU)).kind == "speculate"
    # cost: the cheapest per token that is not too slow against ar
    slow = Option("speculate", user_ms=200.0, cloud_ms=10.0)
    fast = Option("stream", user_ms=69.0, cloud_ms=69.0)
    assert choose(Plan("cost", max_slowdown=1.25), slow, fast).kind == "stream"
    assert choose(Plan("cost", max_slowdown=4.0), slow, fast).kind == "speculate"
    with pytest.raises(ValueError, match="objective"):
        Plan("speed")


def test_a_waiting_stream_is_kept_only_where_it_beats_an_idle_verifier() -> None:
    # a GPU-fast target, a slow edge 50 ms away: streaming while the edge drafts pays
    assert fallback_pays(16.0, 57.0, 50.0, 16.0, 2.8, 0.74, 0.05)
    # this CPU: a stream step (113 ms) outlasts the drafting (100 ms); the tree would wait for it
    assert not fallback_pays(113.0, 100.0, 0.0, 84.0, 2.8, 0.74, 0.05)


def test_measured_rates_say_slower_only_past_the_margin_and_on_enough_verdicts() -> None:
    r = Realized()
    for _ in range(3):
        r.observe("stream", 1, 50.0)
        r.observe("chain", 1, 90.0)
    assert not r.slower(0.05)  # three verdicts a side: not enough to overrule the prices
    r.observe("stream", 1, 50.0)
    r.observe("chain", 2, 180.0)
    assert r.slower(0.05)  # 90 ms a token against 50
    assert not r.slower(0.05, ("prespec",))  # nothing measured of that kind
    for _ in range(20):  # pre-speculated rounds at 40 ms a token
        r.observe("prespec", 3, 120.0)
    assert not r.slower(0.05, ("prespec",))
    assert r.slower(0.05, ("chain", "tree"))
    # within the margin is not slower; recent verdicts outweigh old ones
    q = Realized()
    for _ in range(10):
        q.observe("stream", 1, 50.0)
        q.observe("chain", 1, 52.0)
    assert not q.slower(0.05)
    for _ in range(10):
        q.observe("chain", 1, 40.0)
    spec, seen = q.ms_per_token(("chain",))
    assert spec is not None and spec < 46.0 and seen == 20
    with pytest.raises(ValueError, match="explore_slow"):
        Plan(explore=8, explore_slow=4)


def test_auto_streams_after_a_miss_once_its_trees_measured_slower_and_stays_exact() -> None:
    """A client whose trees after a miss measured far slower than the stream streams after its
    misses (the plans' record says so) and its tokens are still the target's greedy decoding."""
    prompts = [p.text for p in load_prompts(1)]
    target = load_target("smollm2-135m", progress=False, weights="quantized")
    drafter = create_drafter("llama_cpp", "smollm2-135m-q4", n_threads=1)
    with LiveServer(target=target, max_context=4096, weights="quantized") as srv:

        async def run() -> tuple[list[int], list[int], GenerationStats]:
            async with EdgeClient(srv.ws, drafter) as c:
                for _ in range(30):  # as measured before: chains at 10x the stream's ms per token
                    c.learned.realized.observe("stream", 1, 10.0)
                    c.learned.realized.observe("chain", 1, 100.0)
                async for _ in c.generate(prompts[0], max_new_tokens=40, mode="auto"):
                    pass
                assert c.last is not None
                return c.last.prompt_tokens, c.last.tokens, c.last.stats

        ptoks, toks, st = asyncio.run(run())
        ref, _ = greedy_with_gaps(target, ptoks, 40)
    drafter.close()
    assert toks == ref
    if st.plans:  # a miss came: every plan after it streamed on the measurement
        assert set(st.plans) == {"stream (measured)"}, st.plans
    assert st.kind_tokens.get("stream", 0) > 0 and sum(st.kind_tokens.values()) == len(toks) - 1


@pytest.mark.parametrize("objective", ["latency", pytest.param("cost", marks=pytest.mark.slow)])
def test_greedy_auto_is_exactly_the_targets_decoding(objective: str) -> None:
    """SmolLM2's quantized target (its tree rows are bit-identical to decoding): auto's tokens are
    its one-token greedy decoding token for token, across the switches between streamed tokens and
    verified trees."""
    prompts = [p.text for p in load_prompts(2)]
    target = load_target("smollm2-135m", progress=False, weights="quantized")
    drafter = create_drafter("llama_cpp", "smollm2-135m-q4", n_threads=1)
    kinds: dict[str, int] = {}
    with LiveServer(target=target, max_context=4096, weights="quantized") as srv:
        for p in prompts:
            ptoks, toks, st = asyncio.run(
                _run(srv.ws, drafter, p, max_new_tokens=40, mode="auto", objective=objective)
            )
            ref, _ = greedy_with_gaps(target, ptoks, 40)
            assert toks == ref, p[:30]
            for k, n in st.kinds.items():
                kinds[k] = kinds.get(k, 0) + n
    drafter.close()
    assert sum(kinds.values()) > 0 and set(kinds) <= {"stream", "prespec", "chain", "tree"}
    if objective == "latency":
        assert "stream" in kinds and len(kinds) > 1, kinds  # it switched between the kinds


def test_seeded_auto_at_a_temperature_equals_seeded_ar() -> None:
    prompts = [p.text for p in load_prompts(2)]
    drafter = create_drafter("torch", "tiny")
    temp = 2.0
    with LiveServer() as srv:
        for i, p in enumerate(prompts):
            ptoks, got, _ = asyncio.run(
                _run(srv.ws, drafter, p, max_new_tokens=24, mode="auto", temperature=temp, seed=5 + i)
            )
            _, ar, _ = asyncio.run(
                _run(srv.ws, drafter, p, max_new_tokens=24, mode="ar", temperature=temp, seed=5 + i)
            )
            if got != ar:  # a keyed uniform within 1e-5 of a CDF boundary (test_e2e's near-tie)
                j = next(k for k, (a, b) in enumerate(zip(got, ar, strict=False)) if a != b)
                gap = boundary_distance(tiny(), list(ptoks) + ar[:j], 5 + i, temp)
                assert gap < 1e-5, f"prompt {i}: diverged at {j}"
    drafter.close()
