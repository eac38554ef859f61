"""The Triton tree-attention kernel against its plain-torch reference, and node by node against causal
attention over each root-to-node path. CPU runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 where there is no CUDA); the same cases run on CUDA when present.

bfloat16 on the CPU: the interpreter's tl.dot cannot multiply bfloat16, so there the kernel loads and
stores bfloat16 but multiplies in float32 (UPCAST); the bfloat16 dots themselves run on CUDA only.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from treespec_kernels.tree_attention import ancestor_masks, reference_tree_attention, tree_attention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (atol, rtol) against the float32 reference: float32 sums in another order; 16-bit inputs also round
# the probabilities to their dtype before P @ V, and the output to its dtype
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@dataclass
class Session:
    cached: int  # committed positions
    n: int  # new rows
    parents: list[int] | None = None  # tree session: parents of nodes 1..n-1 (rows); None: causal


def chain(nodes: int) -> list[int]:
    return list(range(nodes))


def star(nodes: int) -> list[int]:
    return [0] * nodes


def random_tree(nodes: int, rng: random.Random) -> list[int]:
    return [rng.randrange(k + 1) for k in range(nodes)]


def tree(parents: list[int], cached: int) -> Session:
    return Session(cached, len(parents) + 1, parents)


def make_case(
    sessions: list[Session],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    block_size: int = 16,
    seed: int = 0,
    spare_blocks: int = 3,
) -> dict[str, Any]:
    """Launch arguments with K/V in a shuffled pool: each session's blocks are scattered and
    interleaved with the others' (a fragmented cache). q is a head slice of a wider projection
    output and K/V one layer of a two-layer pool, as the model hands them over."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(x.cached + x.n) // block_size) for x in sessions]
    max_blocks = max([*need, 1]) + 1
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(sessions), max_blocks), -7, dtype=torch.int32)  # unused entries: junk
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = torch.tensor(order[at : at + k], dtype=torch.int32)
        at += k
    pool = torch.randn(2, 2, kv_heads, num_blocks * block_size, head_dim, generator=g)  # [kv, layers, ...]
    t = sum(x.n for x in sessions)
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=g)
    row_starts = [0]
    masks = torch.randint(-(2**62), 2**62, (t,), generator=g)  # junk where causal: must be ignored
    for x in sessions:
        a = row_starts[-1]
        if x.parents is not None:
            masks[a : a + x.n] = ancestor_masks(x.parents)
        row_starts.append(a + x.n)
    dev = torch.device(device)
    return dict(
        q=qkv.to(dtype).to(dev)[:, :heads],
        k_cache=pool[0].to(dtype).to(dev)[1],
        v_cache=pool[1].to(dtype).to(dev)[1],
        block_tables=tables.to(dev),
        row_starts=torch.tensor(row_starts, dtype=torch.int32, device=dev),
        cached_lens=torch.tensor([x.cached for x in sessions], dtype=torch.int32, device=dev),
        tree_masks=masks.to(dev),
        causal=torch.tensor([x.parents is None for x in sessions], device=dev),
        scale=head_dim**-0.5,
        block_size=block_size,
    )


def check_close(case: dict[str, Any]) -> torch.Tensor:
    out = tree_attention(**case)
    ref = reference_tree_attention(**case)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    atol, rtol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out


# --- ancestor_masks ---------------------------------------------------------------------------------


def test_ancestor_masks_small_tree() -> None:
    #   0 - 1 - 3
    #    \- 2 - 4 - 5
    m = ancestor_masks([0, 0, 1, 2, 4]).tolist()
    assert m == [0, 0b1, 0b10, 0b101, 0b1010, 0b11010]


def test_ancestor_masks_64_node_chain_uses_the_sign_bit() -> None:
    m = ancestor_masks(chain(64))
    assert m.dtype == torch.int64 and m.shape == (65,)
    assert int(m[64]) == -1  # all 64 bits: node 64 is bit 63, int64's sign bit
    assert int(m[63]) == 2**63 - 1
    star_m = ancestor_masks(star(64))
    assert int(star_m[64]) == -(2**63)  # only bit 63


@pytest.mark.parametrize(
    ("parents", "match"),
    [([1], r"parents\[0\]"), ([0, 2], r"parents\[1\]"), ([0, -1], r"parents\[1\]"), (star(65), "at most 64")],
)
def test_ancestor_masks_refuses_bad_parents(parents: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ancestor_masks(parents)


# --- against the reference ------------------------------------------------------------------------

rng = random.Random(5)
CASES = {
    # mixed kinds in one launch: a chunked prefill's second chunk, a tree round, a single step,
    # a first prefill chunk (prefix 0)
    "mixed-12:2-d128": (
        [Session(33, 40), tree(random_tree(16, rng), 37), Session(50, 1), Session(0, 9)], 12, 2, 128
    ),
    "mixed-9:3-d64": ([tree(random_tree(9, rng), 70), Session(0, 30), Session(21, 1)], 9, 3, 64),
    "64-nodes-14:2-d64": ([tree(random_tree(64, rng), 45), tree(chain(64), 0)], 14, 2, 64),
    "star-and-1-node-1:1-d128": ([tree(star(20), 17), tree([0], 5), tree([], 3)], 1, 1, 128),
}  # fmt: skip


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = {  # bfloat16 on two cases: the interpreter is slow
    "mixed-12:2-d128": [F32, F16, BF16],
    "mixed-9:3-d64": [F32, F16],
    "64-nodes-14:2-d64": [F32, F16, BF16],
    "star-and-1-node-1:1-d128": [F32, F16],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "dtype"), [(k, d) for k, ds in DTYPES.items() for d in ds], ids=str)
def test_matches_reference(name: str, dtype: torch.dtype, device: str) -> None:
    sessions, heads, kv_heads, head_dim = CASES[name]
    check_close(make_case(sessions, heads, kv_heads, head_dim, dtype, device, seed=len(name)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_any_block_size(block_size: int, device: str) -> None:
    sessions = [tree(random_tree(12, random.Random(block_size)), 29), Session(7, 11)]
    check_close(make_case(sessions, 4, 2, 64, torch.float32, device, block_size=block_size))


@pytest.mark.parametrize("device", DEVICES)
def test_no_masks_means_causal(device: str) -> None:
    case = make_case([Session(19, 13), Session(0, 4)], 6, 2, 64, torch.float32, device)
    causal_out = check_close(case)
    out = tree_attention(**{**case, "tree_masks": None, "causal": None})
    torch.testing.assert_close(out, causal_out, atol=0, rtol=0)
    out = tree_attention(**{**case, "causal": None})  # masks without kinds: still all causal
    torch.testing.assert_close(out, causal_out, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_mask_matters(device: str) -> None:
    """A tree session differs from the same rows run causally (the test can fail)."""
    case = make_case([tree(star(8), 10)], 2, 1, 64, torch.float32, device)
    tree_out = check_close(case)
    causal_out = tree_attention(**{**case, "causal": torch.ones_like(case["causal"])})
    assert (tree_out[2:] - causal_out[2:]).abs().max() > 1e-3
    torch.testing.assert_close(tree_out[:2], causal_out[:2], atol=1e-6, rtol=0)  # rows 0, 1 agree


# --- node by node ---------------------------------------------------------------------------------


def path(parents: list[int], row: int) -> list[int]:
    """Rows from 0 to `row` along the tree."""
    out = [row]
    while out[-1]:
        out.append(parents[out[-1] - 1])
    return out[::-1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("parents", "cached", "dtype"),
    [
        (random_tree(24, random.Random(1)), 21, torch.float32),
        (random_tree(64, random.Random(2)), 3, torch.float16),
    ],
    ids=["24-nodes-fp32", "64-nodes-fp16"],
)
def test_node_equals_causal_attention_over_its_path(
    parents: list[int], cached: int, dtype: torch.dtype, device: str
) -> None:
    heads, kv_heads, head_dim, bs = 6, 2, 64, 8
    case = make_case([tree(parents, cached)], heads, kv_heads, head_dim, dtype, device, block_size=bs)
    out = tree_attention(**case)  # [n, heads, head_dim]
    n = len(parents) + 1
    dev = case["q"].device
    pos = torch.arange(cached + n, device=dev)
    slots = case["block_tables"][0].long()[pos // bs] * bs + pos % bs
    k_seq, v_seq = case["k_cache"][:, slots], case["v_cache"][:, slots]  # [kv_heads, cached + n, hd]
    atol, rtol = TOLERANCE[dtype]
    for row in range(n):
        rows = path(parents, row)
        keep = torch.cat([torch.arange(cached, device=dev), cached + torch.tensor(rows, device=dev)])
        m = len(keep)
        k_path, v_path = k_seq[:, keep].contiguous(), v_seq[:, keep].contiguous()
        # the path as its own causal session: its positions laid out contiguously, block size 1
        path_case = dict(
            q=case["q"][rows].contiguous(),
            k_cache=k_path,
            v_cache=v_path,
            block_tables=torch.arange(m, dtype=torch.int32, device=dev)[None].contiguous(),
            row_starts=torch.tensor([0, len(rows)], dtype=torch.int32, device=dev),
            cached_lens=torch.tensor([cached], dtype=torch.int32, device=dev),
            tree_masks=None,
            causal=None,
            scale=case["scale"],
            block_size=1,
        )
        ref_row = reference_tree_attention(**path_case)[-1]
        torch.testing.assert_close(out[row].float(), ref_row.float(), atol=atol, rtol=rtol)


# --- launcher checks ------------------------------------------------------------------------------


def _bad(case: dict[str, Any], **change: object) -> dict[str, Any]:
    return {**case, **change}


BAD = {
    "q": lambda c: _bad(c, q=c["q"][..., :48]),  # head_dim 48
    "k_cache": lambda c: _bad(c, k_cache=c["k_cache"].half()),
    "v_cache": lambda c: _bad(c, v_cache=c["v_cache"][:, :-1]),
    "block_tables": lambda c: _bad(c, block_tables=c["block_tables"].long()),
    "row_starts": lambda c: _bad(c, row_starts=torch.tensor([0, 3, 2, 20], dtype=torch.int32)),
    "cached_lens": lambda c: _bad(c, cached_lens=c["cached_lens"][:2]),
    "tree_masks": lambda c: _bad(c, tree_masks=c["tree_masks"].int()),
    "causal": lambda c: _bad(c, causal=c["causal"].int()),
    "scale": lambda c: _bad(c, scale=float("nan")),
    "block_size": lambda c: _bad(c, block_size=0),
}


@pytest.mark.parametrize("arg", list(BAD))
def test_launcher_refuses(arg: str) -> None:
    case = make_case([Session(5, 3), tree(star(4), 2), Session(0, 8)], 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match=arg):
        tree_attention(**BAD[arg](case))


def test_launcher_refuses_by_value() -> None:
    case = make_case([Session(5, 3), tree(star(4), 2)], 4, 2, 64, torch.float32, "cpu", block_size=4)
    with pytest.raises(ValueError, match=r"num_heads 4 must be a multiple"):
        tree_attention(**_bad(case, k_cache=torch.zeros(3, 64, 64), v_cache=torch.zeros(3, 64, 64)))
    with pytest.raises(ValueError, match=r"block_tables session 1 needs 4 blocks"):
        short = case["block_tables"][:, :2].contiguous()
        tree_attention(**_bad(case, cached_lens=torch.tensor([5, 9], dtype=torch.int32), block_tables=short))
    bt = case["block_tables"].clone()
    bt[1, 0] = 10_000
    with pytest.raises(ValueError, match=r"block_tables session 1 uses block ids"):
        tree_attention(**_bad(case, block_tables=bt))
    with pytest.raises(ValueError, match="tree_masks is None but session 1"):
        tree_attention(**_bad(case, tree_masks=None))
    big = make_case([tree(star(64), 0), Session(0, 2)], 2, 1, 64, torch.float32, "cpu")
    rows = torch.tensor([0, 66, 67], dtype=torch.int32)  # a tree session of 66 rows
    with pytest.raises(ValueError, match="at most 65"):
        tree_attention(**_bad(big, row_starts=rows))


def test_without_triton_the_module_loads_and_the_launcher_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import treespec_kernels

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "treespec_kernels._triton_tree_attention", None)
    monkeypatch.delattr(treespec_kernels, "_triton_tree_attention", raising=False)
    case = make_case([Session(2, 2)], 2, 1, 64, torch.float32, "cpu")
    reference_tree_attention(**case)  # plain torch
    with pytest.raises(RuntimeError, match="needs Triton"):
        tree_attention(**case)


# --- wide sweep -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(16))
def test_sweep(seed: int, device: str) -> None:
    """Prefixes up to 2k, 1-64 nodes, mixed sessions, every GQA shape and head_dim, all dtypes."""
    r = random.Random(seed)
    heads, kv_heads = r.choice([(9, 3), (12, 2), (14, 2), (1, 1), (8, 8)])
    head_dim = r.choice([64, 128])
    sessions = []
    for _ in range(r.randint(1, 5)):
        kind = r.choice(["tree", "prefill", "step"])
        cached = r.choice([0, r.randint(1, 64), r.randint(64, 2048)])
        if kind == "tree":
            nodes = r.choice([1, r.randint(2, 63), 64])
            shapes: list[Callable[[int], list[int]]] = [chain, star, lambda k: random_tree(k, r)]
            shape = r.choice(shapes)
            sessions.append(tree(shape(nodes), cached))
        else:
            sessions.append(Session(cached, 1 if kind == "step" else r.randint(2, 200)))
    dtype = r.choice([torch.float32, torch.float16, torch.bfloat16])
    case = make_case(
        sessions, heads, kv_heads, head_dim, dtype, device, block_size=r.choice([8, 16, 32]), seed=seed
    )
    check_close(case)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_prefix_2k(dtype: torch.dtype, device: str) -> None:
    """Long prefixes: a 64-node tree and a 1-node tree after 2k positions, a prefill chunk after 1.5k."""
    rng = random.Random(7)
    sessions = [tree(random_tree(64, rng), 2048), Session(1500, 100), tree([0], 2000), Session(2047, 1)]
    check_close(make_case(sessions, 12, 2, 128, dtype, device, block_size=16, seed=3))
