"""The Triton tree-attention kernel wired into the packed forward (`--attention triton`; the default
"model" attention on a GPU). On a CPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 where there is no CUDA): the tiny model's logits with the kernel match SDPA's
and a greedy generation is identical. On CUDA (`cuda` marker) the same in bf16/fp16/fp32, with
greedy divergences at near-ties reported, not failed (docs/architecture.md §4)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from shared.model import (
    LlamaModel,
    build_model,
    decode_step,
    greedy_generate,
    make_tiny_config,
    prefill,
    prefill_chunk,
    tree_round,
)
from shared.model import triton_launch as ta
from shared.model.kv_cache import PagedKVCache
from shared.tree import TokenTree

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
VOCAB = 512


def _interpreting(device: str) -> bool:
    return device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _model(device: str, dtype: torch.dtype = torch.float32) -> LlamaModel:
    if not _interpreting(device):
        pytest.skip("Triton on a CPU needs TRITON_INTERPRET=1 before triton is imported")
    return build_model(make_tiny_config(VOCAB), 0, dtype, device)


def _random_tree(rng: np.random.Generator, nodes: int, base: int) -> TokenTree:
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, nodes)]
    return TokenTree.build(rng.integers(3, VOCAB, nodes), parents, base=base)


def _step(model: LlamaModel, mode: str, full: bool, block_size: int = 16) -> list[torch.Tensor]:
    """Prefill five sequences, then ONE packed forward of: a 20-node tree round, a decode step,
    and (full) a 64-node tree round, a causal prefill chunk, and a tree round with a 40-token tail
    (66 rows: the SDPA fallback). Returns that forward's logits per input."""
    model.set_attention("sdpa")  # the same cache for both (the greedy test covers prefills)
    kv = model.new_kv_cache(64, block_size)
    rng = np.random.default_rng(1)
    for sid, length in enumerate((37, 5, 100, 16, 3)):
        kv.add(sid)
        prefill(model, kv, sid, rng.integers(3, VOCAB, length).tolist(), chunk=64)
    model.set_attention(mode)
    dev = model.device
    tail = rng.integers(3, VOCAB, 40).tolist()
    inputs = [
        tree_round(0, _random_tree(rng, 20, 38), [7]),
        decode_step(1, 11, 5),
        tree_round(2, _random_tree(rng, 64, 101), [9]),
        prefill_chunk(3, rng.integers(3, VOCAB, 30).tolist(), 16),
        tree_round(4, _random_tree(rng, 26, 3 + 40), tail),
    ]
    if not full:
        inputs = inputs[:2]
    moved = [
        type(x)(
            x.seq_id,
            x.tokens.to(dev),
            x.positions.to(dev),
            None if x.tree_mask is None else x.tree_mask.to(dev),
            x.logit_rows.to(dev),
        )
        for x in inputs
    ]
    return model.forward_packed(moved, kv)


TOLERANCE = {torch.float32: 2e-4, torch.float16: 3e-2, torch.bfloat16: 2.5e-1}


@pytest.mark.parametrize(
    ("device", "dtype", "full"),
    [
        ("cpu", torch.float32, False),
        pytest.param("cpu", torch.float32, True, marks=pytest.mark.slow),
        pytest.param("cuda", torch.float32, True, marks=pytest.mark.cuda),
        pytest.param("cuda", torch.float16, True, marks=pytest.mark.cuda),
        pytest.param("cuda", torch.bfloat16, True, marks=pytest.mark.cuda),
    ],
)
def test_triton_forward_matches_sdpa(device: str, dtype: torch.dtype, full: bool) -> None:
    """Tree rounds, a decode step, a prefill chunk and an over-long tree session in one packed forward:
    the kernel's logits equal SDPA's within the dtype's rounding (fp32: 2e-4 on logits of size ~10)."""
    model = _model(device, dtype)
    want = _step(model, "sdpa", full)
    got = _step(model, "triton", full)
    assert model.attention_kernel == "triton" and model.attention_mode == "triton"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape
        err = float((a - b).abs().max())
        assert err <= TOLERANCE[dtype], (i, err)
    # the kernel differs from SDPA only in rounding: the argmax agrees where the top-2 gap is clear
    for a, b in zip(got, want, strict=True):
        top2 = b.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * TOLERANCE[dtype]
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_triton_greedy_generation_is_sdpa_s() -> None:
    model = _model("cpu")
    prompt = list(range(5, 45))
    outs = {}
    for mode in ("sdpa", "triton"):
        model.set_attention(mode)
        outs[mode] = greedy_generate(model, model.new_kv_cache(16, 16), prompt, 12)
    assert outs["triton"] == outs["sdpa"] and len(outs["sdpa"]) == 12


def test_tree_bitmasks_are_the_kernels_ancestor_masks() -> None:
    from treespec_kernels.tree_attention import ancestor_masks

    rng = np.random.default_rng(3)
    for nodes in (1, 2, 7, 33, 63, 64):
        tree = _random_tree(rng, nodes, 10)
        mask = tree_round(0, tree, [5]).tree_mask
        assert mask is not None
        want = ancestor_masks([p + 1 for p in tree.parents.tolist()])
        assert torch.equal(ta.tree_bitmasks(mask), want)
    with pytest.raises(ValueError, match="at most 65 rows"):
        ta.tree_bitmasks(torch.ones(66, 66, dtype=torch.bool))


def test_launch_args_and_block_tables() -> None:
    kv = PagedKVCache(1, 2, 16, 32, 16)
    for sid, n in ((0, 40), (1, 3), (2, 17)):
        kv.add(sid)
        kv.reserve([(sid, n)])
        kv.commit_rows(sid, range(n))
    kv.truncate(0, 40)
    bt = kv.block_tables([2, 0, 1])
    assert bt.dtype == torch.int32 and bt.shape == (3, 3)
    assert bt[0, :2].tolist() == kv.block_table(2) and bt[1].tolist() == kv.block_table(0)
    assert bt[2, :1].tolist() == kv.block_table(1) and bt[2, 1:].tolist() == [0, 0]
    rng = np.random.default_rng(0)
    inputs = [tree_round(0, _random_tree(rng, 5, 41), [3]), decode_step(1, 4, 3)]
    plans = kv.reserve([(x.seq_id, x.num_rows) for x in inputs])
    assert len(plans) == 2
    args = ta.prepare(inputs, [40, 3], kv, torch.device("cpu"))
    assert args.row_starts.tolist() == [0, 6, 7] and args.cached_lens.tolist() == [40, 3]
    assert args.causal is not None and args.causal.tolist() == [False, True]
    assert args.tree_masks is not None and args.tree_masks.shape == (7,) and int(args.tree_masks[6]) == 0
    want = kv.block_tables([0, 1])
    assert args.block_tables.shape == (2, ta.ALIGN) and args.fallback == ()
    assert torch.equal(args.block_tables[:, : want.shape[1]], want)
    assert not args.block_tables[:, want.shape[1] :].any()


def test_launch_args_keep_one_specialisation_as_a_sequence_grows() -> None:
    """Triton compiles a kernel per specialisation of its integer arguments (divisible by 16 or
    not) and pointers (16-byte aligned or not): the table's row stride and every index tensor's
    address must keep the same answers at every length, or a decode step recompiles mid-session
    (on an H200, ~1.4 s at three lengths between 1024 and 1072 before the tables were padded)."""
    kv = PagedKVCache(1, 2, 16, 200, 16)
    kv.add(0)
    kv.add(1)
    kv.reserve([(1, 5)])
    kv.commit_rows(1, range(5))
    keys = set()
    for length in range(0, 1100, 7):
        kv.reserve([(0, max(0, length - kv.cached_len(0)))])
        kv.commit_rows(0, range(length - kv.cached_len(0)))
        for inputs, cached in (
            ([decode_step(0, 1, length)], [length]),
            ([decode_step(0, 1, length), decode_step(1, 2, 5)], [length, 5]),
        ):
            kv.reserve([(x.seq_id, x.num_rows) for x in inputs])
            args = ta.prepare(inputs, cached, kv, torch.device("cpu"))
            assert args.cached_lens.tolist() == cached
            tensors = (args.block_tables, args.row_starts, args.cached_lens)
            aligned = tuple(t.data_ptr() % 16 == 0 for t in tensors)
            keys.add((len(inputs), args.block_tables.stride(0) % 16 == 0, *aligned))
            for x in inputs:
                kv.discard(x.seq_id)
    assert keys == {(1, True, True, True, True), (2, True, True, True, True)}


def test_triton_mode_refuses_what_the_kernel_cannot_serve() -> None:
    model = build_model(make_tiny_config(VOCAB, head_dim=24, hidden_size=192), 0, torch.float32, "cpu")
    with pytest.raises(ValueError, match="head_dim"):
        model.set_attention("triton")
    assert model.attention_mode == "model"


@pytest.mark.cuda
def test_model_attention_is_triton_on_cuda_and_the_pool_has_no_tiled_keys() -> None:
    model = build_model(make_tiny_config(VOCAB), 0, torch.bfloat16, "cuda")
    assert model.attention_mode == "model" and model.attention_kernel == "triton"
    kv = model.new_kv_cache(8, 16)
    assert kv.kt is None and kv.k.device.type == "cuda"
    model.set_attention("sdpa")
    assert model.attention_kernel == "sdpa"


@pytest.mark.cuda
def test_cuda_bf16_greedy_generation_reports_near_tie_divergences() -> None:
    """bf16 on a GPU promises the distribution, not bit-identity (docs/architecture.md §4): greedy
    generations with the kernel and with SDPA are compared; a divergence is accepted only at a
    near-tie of SDPA's logits (top-2 gap under the bf16 tolerance) and is reported."""
    model = build_model(make_tiny_config(VOCAB), 0, torch.bfloat16, "cuda")
    prompt = list(range(5, 45))
    outs = {}
    for mode in ("sdpa", "triton"):
        model.set_attention(mode)
        outs[mode] = greedy_generate(model, model.new_kv_cache(16, 16), prompt, 24)
    if outs["triton"] != outs["sdpa"]:
        first = next(i for i, (a, b) in enumerate(zip(outs["triton"], outs["sdpa"], strict=True)) if a != b)
        model.set_attention("sdpa")
        kv = model.new_kv_cache(16, 16)
        kv.add(0)
        logits = prefill(model, kv, 0, prompt + outs["sdpa"][:first])
        top2 = logits.float().topk(2).values
        gap = float(top2[0] - top2[1])
        print(f"bf16 greedy divergence at token {first}: top-2 gap {gap:.4f}")
        assert gap <= TOLERANCE[torch.bfloat16], gap
