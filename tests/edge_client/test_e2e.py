"""The edge client against the real service: exactly the target's output, in every mode."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.exactness.weights_agreement import greedy
from bench.harness import load_prompts
from edge_client.client import EdgeClient, GenerationError, TreeSpec
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from edge_client.stats import GenerationResult, GenerationStats
from shared.errors import ErrorCode
from shared.model import Target, load_target, prefill
from tests.cloud_verifier.service import LiveServer, tiny
from tests.edge_client.fake_drafter import FakeDrafter

NEAR_TIE = 1e-4


@functools.cache
def smollm2() -> Target:
    return load_target("smollm2-135m", progress=False)


def greedy_with_gaps(target: Target, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
    """Target-only greedy decoding (one forward per token) and the top-2 logit gap at each step."""
    return greedy(target, list(prompt), n)


def compare(got: list[int], ref: list[int], gaps: list[float]) -> str | None:
    """None if equal; 'near-tie at i' if they first differ where the reference's top-2 gap < 1e-4;
    raises AssertionError on any other divergence (docs/architecture.md §4)."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            if gaps[i] < NEAR_TIE:
                return f"near-tie at {i} (gap {gaps[i]:.2e})"
            raise AssertionError(
                f"diverged at {i}: {a} != {b}, reference top-2 gap {gaps[i]:.3g} (not a near-tie)"
            )
    assert len(got) == len(ref), f"length {len(got)} != {len(ref)}"
    return None


async def _generate(
    url: str, drafter: Drafter, prompt: str, **kw: Any
) -> tuple[list[int], list[int], GenerationStats]:
    async with EdgeClient(
        url,
        drafter,
        api_key=kw.pop("api_key", None),
        tree=kw.pop("tree", TreeSpec()),
        couple=bool(kw.pop("couple", True)),
        prespec=kw.pop("prespec", False),
    ) as c:
        async for _ in c.generate(prompt, **kw):
            pass
        assert c.last is not None
        return c.last.prompt_tokens, c.last.tokens, c.last.stats


def _check_greedy(
    target: Target, url: str, drafter: Drafter, prompts: list[str], n: int, tree: TreeSpec
) -> list[str]:
    ties = []
    for p in prompts:
        ptoks, toks, st = asyncio.run(_generate(url, drafter, p, max_new_tokens=n, tree=tree))
        ref, gaps = greedy_with_gaps(target, ptoks, n)
        tie = compare(toks, ref, gaps)
        if tie:
            ties.append(f"{p[:30]!r}: {tie}")
        assert st.tau == pytest.approx(len(toks) / st.rounds)
    if ties:
        print("near-ties:", ties)
    return ties


def test_greedy_tiny_torch_drafter_is_exact() -> None:
    """Default suite: the torch drafter on `tiny` (a self-draft: same weights) and a static tree."""
    prompts = [p.text for p in load_prompts(3)]
    drafter = create_drafter("torch", "tiny")
    with LiveServer() as srv:
        _check_greedy(tiny(), srv.ws, drafter, prompts, 24, TreeSpec())
        _check_greedy(tiny(), srv.ws, drafter, prompts[:1], 24, TreeSpec("budget", budget=12))
        _check_greedy(tiny(), srv.ws, drafter, prompts[:1], 24, TreeSpec("sequence"))
    drafter.close()


def test_greedy_smollm2_llama_cpp_is_exact() -> None:
    """Default suite: the real pair, llama.cpp drafting, 2 prompts x 32 tokens."""
    prompts = [p.text for p in load_prompts(2)]
    drafter = create_drafter("llama_cpp", "smollm2-135m-q4", n_threads=1)
    with LiveServer(target=smollm2(), max_context=4096) as srv:
        _check_greedy(smollm2(), srv.ws, drafter, prompts, 32, TreeSpec())
    drafter.close()


def test_greedy_smollm2_quantized_target_is_exactly_its_own_decoding() -> None:
    """The verifier running SmolLM2's own Q4_1 blocks (--weights quantized), llama.cpp drafting:
    the edge's output is token for token this target's one-token greedy decoding (its tree rows are
    bit-identical to decoding, so not even a near-tie may differ), in the static and budgeted trees."""
    prompts = [p.text for p in load_prompts(2)]
    target = load_target("smollm2-135m", progress=False, weights="quantized")
    drafter = create_drafter("llama_cpp", "smollm2-135m-q4", n_threads=1)
    with LiveServer(target=target, max_context=4096, weights="quantized") as srv:
        for tree in (TreeSpec(), TreeSpec("budget", budget=12)):
            for p in prompts:
                ptoks, toks, st = asyncio.run(_generate(srv.ws, drafter, p, max_new_tokens=32, tree=tree))
                ref, _ = greedy_with_gaps(target, ptoks, 32)
                assert toks == ref, (p[:30], tree.kind)
                assert st.rounds < len(toks)  # the drafts were accepted: it speculated
    drafter.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["llama_cpp", "torch"])
def test_greedy_10_prompts_64_tokens(backend: str) -> None:
    prompts = [p.text for p in load_prompts(10)]
    drafter = create_drafter(
        backend, "smollm2-135m-q4", **({"n_threads": 1} if backend == "llama_cpp" else {})
    )
    with LiveServer(target=smollm2(), max_context=4096) as srv:
        ties = _check_greedy(smollm2(), srv.ws, drafter, prompts, 64, TreeSpec())
    drafter.close()
    print(f"{backend}: 10 prompts x 64 tokens, near-ties: {ties or 'none'}")


def boundary_distance(target: Target, context: list[int], seed: int, temperature: float) -> float:
    """How close the keyed uniform of the next position falls to a CDF boundary of the target's p
    there (in probability mass): the sampling analogue of a near-tie."""
    from cloud_verifier.sampling import SamplingParams, target_probs
    from shared.keyed import keyed_uniform

    kv = target.new_kv_cache(len(context) // 16 + 8, 16)
    kv.add(0)
    with torch.inference_mode():
        logits = prefill(target.model, kv, 0, context)
    p = target_probs(logits.unsqueeze(0), SamplingParams(temperature=temperature))[0].double()
    cdf = torch.cumsum(p, 0) / p.sum()
    u = keyed_uniform(seed, len(context))
    return float((cdf - u).abs().min())


def test_seeded_match_equals_seeded_target_only_sampling() -> None:
    """Seeded sample-and-match emits exactly the tokens of seeded target-only sampling. A tree row's
    logits differ from a one-token forward's by ~1e-6, so where the keyed uniform falls within
    1e-5 of a CDF boundary the two may pick neighbours: reported like a greedy near-tie."""
    prompts = [p.text for p in load_prompts(3)]
    drafter = create_drafter("torch", "tiny")
    temp = 2.0  # the random tiny model is peaked; a high temperature makes the seed matter
    ties = []
    with LiveServer() as srv:
        for i, p in enumerate(prompts):
            ptoks, spec, _ = asyncio.run(
                _generate(srv.ws, drafter, p, max_new_tokens=24, mode="match", temperature=temp, seed=10 + i)
            )
            _, ar, _ = asyncio.run(
                _generate(srv.ws, drafter, p, max_new_tokens=24, mode="ar", temperature=temp, seed=10 + i)
            )
            if spec != ar:
                j = next(k for k, (a, b) in enumerate(zip(spec, ar, strict=False)) if a != b)
                gap = boundary_distance(tiny(), list(ptoks) + ar[:j], 10 + i, temp)
                assert gap < 1e-5, f"prompt {i}: diverged at {j} with the uniform {gap:.2e} from any boundary"
                ties.append((i, j, gap))
            else:
                assert spec == ar
            _, other, _ = asyncio.run(
                _generate(srv.ws, drafter, p, max_new_tokens=24, mode="ar", temperature=2.0, seed=99)
            )
            assert other != ar  # the seed matters: the equality above is not a coincidence
    drafter.close()
    print("sampling near-ties (prompt, position, distance):", ties or "none")


def test_coupled_match_drafts_the_tokens_the_target_samples() -> None:
    """Sample-and-match drafted with the verifier's keyed uniforms (the default) against drafting
    the draft's most likely tokens: the same output (the verifier samples from p either way), and
    with a self-draft (the same weights) the coupled chain is the target's own samples, so nearly
    every round accepts the whole first-child path."""
    prompts = [p.text for p in load_prompts(2)]
    drafter = create_drafter("torch", "tiny")
    spec = TreeSpec()
    depth = spec.chain_depth
    with LiveServer() as srv:
        for i, p in enumerate(prompts):
            kw = {"max_new_tokens": 32, "mode": "match", "temperature": 2.0, "seed": 40 + i}
            _, coupled, st_c = asyncio.run(_generate(srv.ws, drafter, p, couple=True, **kw))
            _, plain, st_p = asyncio.run(_generate(srv.ws, drafter, p, couple=False, **kw))
            assert coupled == plain
            tau_c, tau_p = st_c.tau, st_p.tau
            print(f"prompt {i}: tau coupled {tau_c:.2f}, uncoupled {tau_p:.2f} (chain depth {depth})")
            assert tau_c >= 0.8 * (depth + 1)
            assert tau_c >= 1.5 * tau_p
    drafter.close()


@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_stochastic_modes_end_to_end_with_a_trusted_key(mode: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("edge-key trusted\nplain-key\n")
    drafter = create_drafter("torch", "tiny")
    with LiveServer(api_key_file=str(keys)) as srv:
        _ptoks, toks, st = asyncio.run(
            _generate(
                srv.ws,
                drafter,
                "Tell me a story.",
                max_new_tokens=24,
                mode=mode,
                temperature=1.0,
                seed=3,
                api_key="edge-key",
            )
        )
        assert len(toks) == 24 or toks[-1] in tiny().eos_ids
        acc = st.accepted_per_depth
        print(f"{mode}: tau {st.tau:.2f}, acceptance per depth {np.round(acc, 2).tolist()}")
        assert st.tau > 1.5  # a self-draft at the target's temperature accepts most draws
        # a "sequence" draft samples its chain from q as well
        _, chain_toks, _ = asyncio.run(
            _generate(
                srv.ws,
                drafter,
                "Tell me a story.",
                max_new_tokens=12,
                mode=mode,
                temperature=1.0,
                seed=3,
                api_key="edge-key",
                tree=TreeSpec("sequence"),
            )
        )
        assert len(chain_toks) == 12 or chain_toks[-1] in tiny().eos_ids
        with pytest.raises(GenerationError) as info:
            asyncio.run(
                _generate(
                    srv.ws, drafter, "x", max_new_tokens=4, mode=mode, temperature=1.0, api_key="plain-key"
                )
            )
        assert info.value.code is ErrorCode.MODE_NOT_ALLOWED
    drafter.close()


def test_a_foreign_vocabulary_is_refused_before_generation() -> None:
    with LiveServer() as srv:
        with pytest.raises(GenerationError) as info:
            asyncio.run(_generate(srv.ws, FakeDrafter(64), "hello", max_new_tokens=4))
        assert info.value.code is ErrorCode.VOCAB_MISMATCH
        assert "vocabulary" in str(info.value) and "tiny" in str(info.value)


def test_cli_json_is_one_line() -> None:
    with LiveServer() as srv:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "edge_client",
                "generate",
                "--server",
                srv.ws,
                "--draft",
                "tiny",
                "--drafter",
                "torch",
                "--max-tokens",
                "12",
                "--json",
                "--tree",
                "1,2,1",
                "Say hi",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
    lines = out.stdout.splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert set(d) == {"text", "prompt_tokens", "tokens", "stats"}
    assert set(d["stats"]) >= {
        "rounds",
        "tau",
        "accepted_per_depth",
        "rtt_ms",
        "verify_ms",
        "bytes_up",
        "bytes_down",
    }
    assert d["stats"]["tau"] == pytest.approx(len(d["tokens"]) / d["stats"]["rounds"])
    assert len(d["tokens"]) <= 12 and d["prompt_tokens"]


def test_stop_strings_cut_the_text_and_cancel() -> None:
    drafter = create_drafter("torch", "tiny")
    with LiveServer() as srv:

        async def go() -> tuple[str, str, GenerationResult]:
            async with EdgeClient(srv.ws, drafter) as c:
                full = ""
                async for chunk in c.generate("Say something", max_new_tokens=40):
                    full += chunk
                assert c.last is not None and len(full) > 4
                stop = full[3:5]
                cut = ""
                async for chunk in c.generate("Say something", max_new_tokens=40, stop=[stop]):
                    cut += chunk
                assert c.last is not None
                return full, cut, c.last

        full, cut, gen = asyncio.run(go())
    assert cut == full[: full.index(full[3:5])]
    assert gen.reason == "stop_string"
    drafter.close()


# ---------------------------------------------------------------------------- the real pair (slow)
PAIR_TARGET, PAIR_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b-q4"


@functools.cache
def qwen15() -> Target:
    target = load_target(PAIR_TARGET, progress=False)
    target.model.prepare(release=True)  # one copy of the 7.1 GB of weights
    return target


def _pair_tree() -> TreeSpec:
    from edge_client.defaults import recommended_tree
    from shared.tree import ExpansionConfig

    return TreeSpec("static", ExpansionConfig.parse(recommended_tree(PAIR_DRAFT)))


@pytest.mark.slow
def test_pair_greedy_through_edge_and_verifier_equals_ar() -> None:
    """Qwen2.5-Coder-0.5B drafting (llama.cpp) for the 1.5B: on 10 dev prompts (5 HumanEval raw, 5
    Spec-Bench chat) x 64 tokens, the tree with pre-speculation emits exactly the tokens of
    target-only `ar` through the same verifier (a divergence only at a reference near-tie)."""
    from bench.harness import load_suite

    drafter = create_drafter("llama_cpp", PAIR_DRAFT, n_threads=1)
    ties, taus = [], []
    with LiveServer(target=qwen15(), max_context=4096, kv_blocks=192, max_sessions=4) as srv:
        for p in load_suite(5, 5):
            kw = {"raw": p.raw, "max_new_tokens": 64}
            ptoks, ar, _ = asyncio.run(_generate(srv.ws, drafter, p.text, mode="ar", **kw))
            _, spec, st = asyncio.run(
                _generate(srv.ws, drafter, p.text, tree=_pair_tree(), prespec=True, **kw)
            )
            if spec != ar:
                ref, gaps = greedy_with_gaps(qwen15(), ptoks, 64)
                tie = compare(spec, ref, gaps)  # raises unless it is a near-tie
                ties.append((p.question_id, tie))
            taus.append(round(st.tau, 2))
    drafter.close()
    print(f"pair greedy: tau per prompt {taus}; near-ties {ties or 'none'}")


@pytest.mark.slow
def test_pair_seeded_match_equals_seeded_ar() -> None:
    """Seeded sample-and-match on the pair emits the tokens of seeded target-only sampling (T 0.7)."""
    from bench.harness import load_suite

    drafter = create_drafter("llama_cpp", PAIR_DRAFT, n_threads=1)
    ties = []
    with LiveServer(target=qwen15(), max_context=4096, kv_blocks=192, max_sessions=4) as srv:
        for i, p in enumerate(load_suite(1, 2)):
            kw = {"raw": p.raw, "max_new_tokens": 48, "temperature": 0.7, "seed": 70 + i}
            ptoks, spec, _ = asyncio.run(
                _generate(srv.ws, drafter, p.text, mode="match", tree=_pair_tree(), prespec=True, **kw)
            )
            _, ar, _ = asyncio.run(_generate(srv.ws, drafter, p.text, mode="ar", **kw))
            if spec != ar:
                j = next(k for k, (a, b) in enumerate(zip(spec, ar, strict=False)) if a != b)
                gap = boundary_distance(qwen15(), list(ptoks) + ar[:j], 70 + i, 0.7)
                assert gap < 1e-5, f"prompt {i}: diverged at {j} with the uniform {gap:.2e} from any boundary"
                ties.append((i, j, gap))
    drafter.close()
    print("pair seeded match near-ties (prompt, position, distance):", ties or "none")
