"""Tensor parallelism on CUDA GPUs with NCCL (cloud_verifier.parallel) at TP=2: needs 2 GPUs.

Skipped unless torch.cuda.device_count() >= 2 (`bench.kernels.gpu_check`'s tensor_parallel stage runs this
file on such a machine). The tiny model in bf16 on cuda:0 (TP=1) against the group on cuda:0 and
cuda:1: the partial sums of o and down are rounded to bf16 before the all-reduce, so the logits
differ by bf16 rounding: within BF16_TOL (absolute; tiny's logits are O(1) and bf16 keeps 8 bits).
Greedy decoding must give the same tokens, or diverge only at a near-tie (the two tokens' TP=1
logits within BF16_TOL), which is reported as a warning. Then a killed worker breaks the group
within seconds and a forward fails at once instead of waiting on NCCL.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
import warnings
from collections.abc import Iterator

import pytest
import torch

from cloud_verifier import parallel
from cloud_verifier.server import ThreadedServer
from cloud_verifier.server_config import ServerConfig
from shared.model import (
    Target,
    decode_step,
    load_target,
    prefill,
    prefill_chunk,
    round_keep,
    tree_round,
)
from shared.model.generate import greedy_generate
from tests.cloud_verifier.helpers import max_diff, random_tree

BF16_TOL = 0.1  # |logit(TP=2) - logit(TP=1)| of tiny in bf16 (not yet measured: no 2-GPU machine so far)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="tensor parallelism on CUDA needs 2 GPUs",
    ),
    pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="torch without NCCL"),
]


@pytest.fixture(scope="module")
def ref() -> Target:
    return load_target("tiny", dtype="bf16", device="cuda", progress=False)


@pytest.fixture(scope="module")
def tp2() -> Iterator[Target]:
    group = parallel.start(2, "tiny", dtype="bf16", device="cuda")
    try:
        yield parallel.load_sharded_target(group, "tiny", dtype="bf16", device="cuda", progress=False)
    finally:
        group.close()


def _round(t: Target, committed: list[int], tail: int, seed: int, cond: int) -> list[torch.Tensor]:
    """Prefill, a tree round, commit a path, one decode step: every logit along the way."""
    rng = random.Random(seed)
    base = len(committed) - cond
    tree = random_tree(rng, 14, t.config.vocab_size, base, committed[base:])
    kv = t.new_kv_cache(64, 16)
    kv.add(4)
    pre = prefill(t.model, kv, 4, committed[:-tail])
    (lg,) = t.model.forward_packed([tree_round(4, tree, committed[-tail:])], kv)
    accepted = tree.path(rng.randrange(tree.num_nodes))
    kv.commit_rows(4, round_keep(tail, accepted))
    (after,) = t.model.forward_packed([decode_step(4, 7, len(committed) + len(accepted))], kv)
    kv.free(4)
    return [pre, lg, after]


def test_group_runs_nccl_on_one_gpu_a_rank_with_the_tp1_attention(tp2: Target, ref: Target) -> None:
    group = tp2.model.group
    assert isinstance(group, parallel.TPGroup)
    assert (group.backend, group.device) == ("nccl", torch.device("cuda", 0))
    assert tp2.model.dtype == torch.bfloat16 and tp2.model.device == torch.device("cuda", 0)
    assert tp2.model.attention_kernel == ref.model.attention_kernel
    kv = tp2.new_kv_cache(8, 16)
    assert isinstance(kv, parallel.ShardedKVCache) and kv.consistent()


@pytest.mark.parametrize(("tail", "cond"), [(1, 0), (3, 0), (1, 2)])
def test_tp2_logits_match_tp1_within_bf16(tp2: Target, ref: Target, tail: int, cond: int) -> None:
    rng = random.Random(tail * 10 + cond)
    committed = [rng.randrange(ref.config.vocab_size) for _ in range(37)]
    for a, b in zip(
        _round(tp2, committed, tail, 5, cond), _round(ref, committed, tail, 5, cond), strict=True
    ):
        assert a.shape == b.shape and a.device.type == "cuda"
        assert max_diff(a, b) <= BF16_TOL, f"max |Δlogit| {max_diff(a, b):.3g}"


def test_tp2_greedy_equals_tp1_or_diverges_at_a_near_tie(tp2: Target, ref: Target) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(ref.config.vocab_size) for _ in range(30)]
    want = greedy_generate(ref.model, ref.new_kv_cache(64, 16), prompt, 48, eos_ids=())
    got = greedy_generate(tp2.model, tp2.new_kv_cache(64, 16), prompt, 48, eos_ids=())
    if got == want:
        return
    i, gap = _first_divergence(ref, prompt, want, got)
    assert 0 <= gap <= BF16_TOL, f"TP=2 diverges from TP=1 at token {i} with a TP=1 logit gap of {gap:.3g}"
    warnings.warn(
        f"TP=2 greedy diverges from TP=1 at token {i} of 48 at a near-tie (gap {gap:.3g})", stacklevel=1
    )


def _first_divergence(ref: Target, prompt: list[int], want: list[int], got: list[int]) -> tuple[int, float]:
    """Where TP=2's greedy tokens leave TP=1's, and TP=1's logit gap between the two tokens there."""
    i = next(j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    kv = ref.new_kv_cache(64, 16)
    kv.add(1)
    (lg,) = ref.model.forward_packed([prefill_chunk(1, prompt + want[:i], 0, logits_last=True)], kv)
    kv.free(1)
    return i, float(lg[0, want[i]].float() - lg[0, got[i]].float())


async def _client_greedy(url: str, prompt: str, n: int) -> tuple[list[int], list[int]]:
    from edge_client.client import EdgeClient
    from edge_client.drafters.registry import create_drafter

    drafter = create_drafter("torch", "tiny")
    try:
        async with EdgeClient(url, drafter, resume=False) as c:
            async for _ in c.generate(prompt, max_new_tokens=n):
                pass
            assert c.last is not None
            return list(c.last.prompt_tokens), list(c.last.tokens)
    finally:
        drafter.close()


def test_edge_client_greedy_through_a_tp2_verifier_equals_tp1_or_diverges_at_a_near_tie(
    tp2: Target, ref: Target
) -> None:
    """The service on rank 0 of the NCCL group, the real edge client (tiny drafter), greedy."""
    cfg = ServerConfig(
        model="tiny", device="cuda", dtype="bf16", measure_cost=False, max_sessions=4, max_context=512
    )
    out = []
    for t in (ref, tp2):
        with ThreadedServer(cfg, target=t) as srv:
            out.append(asyncio.run(_client_greedy(srv.url, "def fibonacci(n):", 40)))
    (prompt, want), (_, got) = out
    assert len(want) == len(got) == 40
    if got != want:
        i, gap = _first_divergence(ref, prompt, want, got)
        assert 0 <= gap <= BF16_TOL, (
            f"TP=2 diverges from TP=1 at token {i} with a TP=1 logit gap of {gap:.3g}"
        )
        warnings.warn(
            f"TP=2 (service) diverges from TP=1 at token {i} at a near-tie (gap {gap:.3g})", stacklevel=1
        )


def test_a_killed_worker_breaks_the_nccl_group_and_forwards_fail_at_once(tp2: Target) -> None:
    """(Runs last in the module: it breaks the group.)"""
    group = tp2.model.group
    assert isinstance(group, parallel.TPGroup) and group.procs
    kv = tp2.new_kv_cache(8, 16)
    kv.add(1)
    prefill(tp2.model, kv, 1, [1, 2, 3])
    group.procs[0].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    while group.alive():
        assert time.monotonic() - t0 < 5, "the group still alive five seconds after a rank died"
        time.sleep(0.05)
    assert group.error is not None and "tensor-parallel rank 1 died: exit code -9" in group.error
    t0 = time.monotonic()
    with pytest.raises(parallel.TensorParallelError, match="rank 1 died"):
        tp2.model.forward_packed([decode_step(1, 3, 3)], kv)
    assert time.monotonic() - t0 < 1.0
