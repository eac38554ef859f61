"""The landing model on the small pair (SmolLM2-135M fp32 target, its Q4 GGUF drafting with
llama.cpp) at T 0.7 with the keyed uniforms: after a mismatch (the target's keyed sample is not the
draft's coupled token) the target's token is among the first F candidates after the coupled token
more often in the landing order than in the draft's most likely order, on the same positions
(bench.simulation.outcomes.mismatch_ranks, teacher-forced on the target's own samples).

Measured (16 Spec-Bench / HumanEval dev prompts x 96 tokens, 80 mismatches): first
candidate 0.36 (landing) against 0.14 (draft's order), first three 0.75 against 0.35, first eight
0.84 against 0.51; the learned sigma settles near 0.01-0.02 of the CDF.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.simulation.outcomes import mismatch_ranks, top_f_rates
from edge_client.trees import Coupling
from edge_client.trees.sampling import Landing

T = 0.7


@pytest.mark.slow
def test_after_a_mismatch_the_landing_order_finds_the_bonus_more_often() -> None:
    import torch

    from bench.exactness.agreement import target_output
    from bench.harness import load_suite
    from edge_client.drafters.registry import create_drafter
    from shared.model import load_target

    torch.set_num_threads(1)
    target = load_target("smollm2-135m", progress=False)
    target.model.prepare(release=True)
    tok = target.tokenizer
    drafter = create_drafter("llama_cpp", "smollm2-135m-q4", n_threads=1, max_nodes=256)
    landing = Landing()
    ranks: list[tuple[int, int]] = []
    try:
        for i, p in enumerate(load_suite(6, 6)):
            if p.raw:
                ids = tok.encode(p.text, add_special=True)
            else:
                chat = tok.apply_chat_template([{"role": "user", "content": p.text}])
                ids = tok.encode(chat, add_special=False)
            out = target_output(target, ids, 96, T, seed=i)
            ranks += mismatch_ranks(drafter, ids, out, Coupling(i, T, landing=landing), 8)
    finally:
        drafter.close()
    rates = top_f_rates(ranks, 8)
    print(f"{len(ranks)} mismatches, sigma {landing.sigma:.4f}: {rates}")
    assert len(ranks) >= 25
    land, draft = np.asarray(rates["landing"]), np.asarray(rates["draft"])
    assert land[0] > draft[0] + 0.1  # the first candidate after the coupled token
    assert land[2] > draft[2] + 0.2  # the first three
    assert bool((land >= draft).all())
    assert 1e-3 < landing.sigma < 0.2 and landing.seen > 10
