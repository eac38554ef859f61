"""The CPU kernels (treespec_kernels/csrc/cpu_attention.cpp): batch-invariant tree attention, RMSNorm.

Three properties: it computes attention (against SDPA with the same mask, to float32 rounding);
a row's output is bit-identical however the forward around it is shaped (a tree node against
its path decoded token by token, whatever the pool layout, block fragmentation, prefix length or
row count); and the pool's tiled keys stay equal to its keys through writes and commits. It is
built on first use; on a machine with a C++ compiler it must build, so a failed build fails here.
"""

from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from shared.model import build_model, decode_step, kv_cache, make_tiny_config, prefill
from shared.model.kv_cache import TILE, PagedKVCache
from treespec_kernels import cpu_attention as ck
from treespec_kernels.cpp_build import ENV, disabled

if disabled():
    pytest.skip(f"{ENV}=off", allow_module_level=True)


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert ck.load() is not None, ck.error()


def _tree(rng: random.Random, n: int) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a random tree in topological order."""
    parents = [-1] + [rng.randint(max(0, i - 4), i - 1) for i in range(1, n)]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, j] = True
            j = parents[j]
    return allowed


def _pool(kv_heads: int, blocks: int, hd: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    k = torch.randn(kv_heads, blocks * TILE, hd, generator=gen)
    v = torch.randn(kv_heads, blocks * TILE, hd, generator=gen)
    kt = k.reshape(kv_heads, blocks, TILE, hd).transpose(2, 3).contiguous()
    return k, v, kt


def _slots(rng: random.Random, length: int, blocks: int, fragmented: bool) -> torch.Tensor:
    count = -(-length // TILE)
    table = rng.sample(range(blocks), count) if fragmented else list(range(3, 3 + count))
    pos = torch.arange(length)
    return torch.tensor(table)[pos // TILE] * TILE + pos % TILE


# head sizes and query heads per KV head: SmolLM2 (64, 9:3), Qwen2.5-Coder-0.5B (64, 14:2) and -1.5B
# (128, 12:2), and a small one
@pytest.mark.parametrize(("hd", "group"), [(16, 3), (64, 3), (64, 7), (128, 6)])
@pytest.mark.parametrize("seed", range(6))
def test_matches_sdpa_and_each_row_equals_its_path_decoded_alone(hd: int, group: int, seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kv_heads, blocks = 2, 160
    cached, n = rng.choice([0, 1, 15, 16, 17, rng.randint(2, 1500)]), rng.randint(1, 24)
    allowed = _tree(rng, n) if seed % 3 else torch.ones(n, n, dtype=torch.bool).tril_()
    k, v, kt = _pool(kv_heads, blocks, hd, gen)
    slots = _slots(rng, cached + n, blocks, fragmented=seed % 2 == 1)
    q = torch.randn(kv_heads, group * n, hd, generator=gen)
    scale = hd**-0.5

    out = ck.tree_attention(q, kt, v, slots, allowed, cached, scale)

    ref = ck.reference_tree_attention(q, k, v, slots, allowed, cached, scale)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5), float((out - ref).abs().max())

    # every row again, alone, as the last token of its path decoded one at a time
    per_row = out.reshape(kv_heads, group, n, hd)
    for i in range(n):
        path = allowed[i].nonzero().flatten()
        alone_slots = torch.cat((slots[:cached], slots[cached + path]))
        qi = q.reshape(kv_heads, group, n, hd)[:, :, i].contiguous()
        one = torch.ones(1, 1, dtype=torch.bool)
        alone = ck.tree_attention(qi, kt, v, alone_slots, one, cached + len(path) - 1, scale)
        assert torch.equal(alone, per_row[:, :, i]), f"row {i} differs from its path decoded alone"


def test_refuses_bad_input_with_a_message() -> None:
    gen = torch.Generator().manual_seed(0)
    _k, v, kt = _pool(2, 4, 16, gen)
    q = torch.randn(2, 3, 16, generator=gen)
    one = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ck.tree_attention(q, kt, v, torch.tensor([0, 999]), one, 1, 0.25)
    with pytest.raises(RuntimeError, match="slots must hold cached"):
        ck.tree_attention(q, kt, v, torch.tensor([0, 1, 2]), one, 1, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        ck.tree_attention(q.double(), kt, v, torch.tensor([0, 1]), one, 1, 0.25)
    with pytest.raises(RuntimeError, match="head_dim"):
        ck.tree_attention(q[..., :8].contiguous(), kt[:, :, :8].contiguous(), v[..., :8].contiguous(),
                          torch.tensor([0, 1]), one, 1, 0.25)  # fmt: skip


@pytest.mark.parametrize("writer", ["kernel", "torch"])
def test_tiled_keys_follow_writes_and_commits(writer: str) -> None:
    kv = PagedKVCache(2, 2, 16, num_blocks=8, block_size=16, tiled_keys=True)
    if writer == "torch":  # the fallback when the kernel is not built
        kv._write_tiled = kv_cache._put_tiled
    gen = torch.Generator().manual_seed(1)
    kv.add(0)
    for rows, keep in ((20, list(range(20))), (9, [0, 3, 4, 8]), (5, [0, 2])):
        (plan,) = kv.reserve([(0, rows)])
        for layer in range(2):
            kv.write(layer, plan.write, torch.randn(rows, 2, 16, generator=gen), torch.randn(rows, 2, 16))
        kv.commit_rows(0, keep)
        assert kv.kt is not None
        untiled = kv.kt.transpose(3, 4).reshape(kv.k.shape)
        assert torch.equal(untiled, kv.k)
    with pytest.raises(ValueError, match="multiple of 16"):
        PagedKVCache(1, 1, 16, num_blocks=2, block_size=8, tiled_keys=True)


def test_model_uses_it_and_sdpa_mode_does_not() -> None:
    model = build_model(make_tiny_config(), seed=0, dtype="float32", device="cpu")
    assert model.attention_kernel == "cpu-invariant"
    kv = model.new_kv_cache(16)
    assert kv.kt is not None
    kv.add(0)
    prompt = list(range(5, 45))
    prefill(model, kv, 0, prompt)
    (ours,) = model.forward_packed([decode_step(0, 7, len(prompt))], kv)
    kv.discard(0)
    model.set_attention("sdpa")
    try:
        assert model.attention_kernel == "sdpa" and model.attention_mode == "sdpa"
        (sdpa,) = model.forward_packed([decode_step(0, 7, len(prompt))], kv)
    finally:
        model.set_attention("model")
    # the same function, computed two ways: float32 rounding apart, not bit-identical in general
    assert torch.allclose(ours, sdpa, atol=1e-4), float((ours - sdpa).abs().max())


@pytest.mark.parametrize("hidden", [576, 64, 13])
def test_rms_norm_matches_torch_and_is_row_invariant(hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(33, hidden, generator=gen) * 40  # SmolLM2's residual stream reaches the hundreds
    w = torch.randn(hidden, generator=gen)
    y = ck.rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x.double(), (hidden,), w.double(), 1e-5)
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6), float((y.double() - ref).abs().max())
    for rows in (slice(0, 1), slice(5, 9), slice(32, 33)):
        assert torch.equal(ck.rms_norm(x[rows], w, 1e-5), y[rows])
    with pytest.raises(RuntimeError, match="weight must be"):
        ck.rms_norm(x, w[:-1], 1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(3, 1, 64), (12, 2, 128), (4, 2, 16)])
def test_rope_store_equals_rotary_then_write_bit_for_bit(heads: int, kv_heads: int, hd: int) -> None:
    from shared.model.llama import Rotary

    cfg = dataclasses.replace(make_tiny_config(), head_dim=hd, num_heads=heads, num_kv_heads=kv_heads)
    rotary = Rotary(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(hd)
    rows, qk = 7, heads + kv_heads
    wide = torch.randn(rows, (qk + kv_heads) * hd + 5, generator=gen) * 30
    qkv = wide[:, 5:]  # a view with a row stride of its own, as a sliced projection output is
    cos, sin = rotary.tables(torch.tensor([0, 1, 2, 40, 41, 900, 4095]), torch.float32)
    slots = torch.tensor([16, 17, 31, 2, 40, 63, 0])
    pools = [PagedKVCache(1, kv_heads, hd, num_blocks=4, block_size=16, tiled_keys=True) for _ in range(2)]

    ref = rotary.apply(qkv[:, : qk * hd].reshape(rows, qk, hd), cos, sin)
    pools[0].write(0, slots, ref[:, heads:], qkv[:, qk * hd :].reshape(rows, kv_heads, hd))
    q = ck.rope_store(qkv, cos.view(rows, hd), sin.view(rows, hd), slots, pools[1].layer_pool(0), heads)
    assert q.shape == (rows, heads, hd) and q.is_contiguous()
    assert torch.equal(q, ref[:, :heads])
    for a, b in zip(pools[0].layer_pool(0), pools[1].layer_pool(0), strict=True):
        assert torch.equal(a, b)

    with pytest.raises(RuntimeError, match="slot out of range"):
        ck.rope_store(qkv, cos.view(rows, hd), sin.view(rows, hd), slots + 64, pools[1].layer_pool(0), heads)
    with pytest.raises(RuntimeError, match="qkv must be"):
        ck.rope_store(qkv, cos.view(rows, hd), sin.view(rows, hd), slots, pools[1].layer_pool(0), heads + 1)
    with pytest.raises(RuntimeError, match="float32"):
        ck.rope_store(
            qkv.double(), cos.view(rows, hd), sin.view(rows, hd), slots, pools[1].layer_pool(0), heads
        )


def test_the_model_fuses_rope_and_store_with_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model(make_tiny_config(), seed=0, dtype="float32", device="cpu")
    prompt, out = list(range(5, 45)), {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TREESPEC_FUSED_ROPE", flag)
        kv = model.new_kv_cache(16)
        assert model._fused_rope(kv) == (flag == "1")
        kv.add(0)
        prefill(model, kv, 0, prompt)
        (logits,) = model.forward_packed([decode_step(0, 7, len(prompt))], kv)
        assert kv.kt is not None
        out[flag] = (logits, kv.k.clone(), kv.v.clone(), kv.kt)
    for a, b in zip(out["0"], out["1"], strict=True):
        assert torch.equal(a, b)
