"""Tensor parallelism on the real 0.5B model (slow): prefill, a tree round and greedy decoding of
Qwen2.5-Coder-0.5B at TP=2 against TP=1. In a module of its own: `test_parallel.py`'s module-wide
TP=2 group of the tiny model holds this process's one group until that module ends."""

from __future__ import annotations

import random

import pytest

from cloud_verifier import parallel
from shared.model import load_target
from tests.cloud_verifier.helpers import max_diff
from tests.cloud_verifier.test_parallel import QWEN_TOL, _round


@pytest.mark.slow
def test_qwen_tp2_matches_tp1() -> None:
    """Prefill, a tree round and greedy decoding of Qwen2.5-Coder-0.5B at TP=2 against TP=1 (one
    model in memory at a time: the TP=1 figures first)."""
    from shared.model import greedy_generate

    name = "qwen2.5-coder-0.5b"
    rng = random.Random(0)
    ref = load_target(name, device="cpu", progress=False)
    vocab = ref.config.vocab_size
    committed = [rng.randrange(1000, 20000) for _ in range(40)]
    want_round = _round(ref, committed, 1, 9, 0)
    want_cond = _round(ref, committed, 1, 9, 2)
    kv = ref.new_kv_cache(64, 16)
    want_tokens = greedy_generate(ref.model, kv, committed, 24, eos_ids=())
    del ref, kv

    group = parallel.start(2, name, device="cpu", threads=2)
    try:
        tp = parallel.load_sharded_target(group, name, device="cpu", progress=False)
        assert tp.config.vocab_size == vocab and tp.model.config.num_kv_heads == 1
        got_round = _round(tp, committed, 1, 9, 0)
        got_cond = _round(tp, committed, 1, 9, 2)
        for a, b in zip((*got_round, *got_cond), (*want_round, *want_cond), strict=True):
            assert max_diff(a, b) <= QWEN_TOL, f"max |Δlogit| {max_diff(a, b):.3g}"
        kv = tp.new_kv_cache(64, 16)
        got_tokens = greedy_generate(tp.model, kv, committed, 24, eos_ids=())
        assert got_tokens == want_tokens
    finally:
        group.close()
