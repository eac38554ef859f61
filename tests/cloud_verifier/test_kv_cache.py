"""Paged KV bookkeeping on CPU with no model: allocation, commit of arbitrary paths, exhaustion, free.

Each written row's K holds a recognisable value (seq id, row tag), so the tests can read back
where every row ended up.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from shared.model.kv_cache import KVCacheFull, PagedKVCache

LAYERS, HEADS, DIM = 2, 2, 4


def make(num_blocks: int = 8, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(LAYERS, HEADS, DIM, num_blocks, block_size, torch.float32, "cpu")


def write_rows(kv: PagedKVCache, seq: int, tags: list[float]) -> None:
    """One forward's worth of rows for `seq`, row i tagged tags[i] (K = tag, V = -tag)."""
    (plan,) = kv.reserve([(seq, len(tags))])
    val = torch.tensor(tags, dtype=torch.float32)[:, None, None].expand(len(tags), HEADS, DIM)
    for layer in range(LAYERS):
        kv.write(layer, plan.write, val + layer, -(val + layer))


def cached_tags(kv: PagedKVCache, seq: int) -> list[float]:
    k, v = kv.sequence_kv(seq)
    assert torch.equal(v, -k)
    for layer in range(LAYERS):
        assert torch.equal(k[layer] - layer, k[0])  # every layer moved together
    return k[0, 0, :, 0].tolist()


def read_tags(kv: PagedKVCache, seq: int) -> list[float]:
    """What attention would read for the sequence (cache + scratch) through the forward's layout."""
    (plan,) = kv.reserve([(seq, kv.scratch_len(seq))])
    k, _ = kv.layer_kv(0, plan.read)
    return k[0, :, 0].tolist()


def test_allocation_grows_by_blocks_and_free_releases() -> None:
    kv = make(num_blocks=8, block_size=4)
    kv.add(1)
    write_rows(kv, 1, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert kv.blocks_in_use == 2 and kv.num_free_blocks == 6
    kv.commit_rows(1, range(5))
    assert kv.cached_len(1) == 5 and cached_tags(kv, 1) == [1, 2, 3, 4, 5]
    assert kv.blocks_in_use == 2
    kv.add(2)
    write_rows(kv, 2, [7.0] * 9)
    assert kv.blocks_in_use == 5
    kv.free(2)
    assert kv.blocks_in_use == 2 and kv.sequences() == [1]
    kv.free(1)
    assert kv.blocks_in_use == 0 and kv.num_free_blocks == 8
    with pytest.raises(KeyError):
        kv.cached_len(1)


def test_commit_tree_path_moves_rows_and_releases_rest() -> None:
    kv = make(num_blocks=8, block_size=4)
    kv.add(0)
    write_rows(kv, 0, [10.0, 11.0, 12.0])
    kv.commit_rows(0, range(3))
    # round: row 0 + 9 tree nodes (tags 100 + row)
    write_rows(kv, 0, [100.0 + r for r in range(10)])
    assert kv.blocks_in_use == 4  # 13 positions
    kv.commit(0, [1, 4, 8])  # rows 0, 2, 5, 9
    assert kv.cached_len(0) == 7
    assert cached_tags(kv, 0) == [10, 11, 12, 100, 102, 105, 109]
    assert kv.blocks_in_use == 2 and kv.scratch_len(0) == 0


@pytest.mark.parametrize("seed", range(20))
def test_commit_random_paths_equals_straight_writes(seed: int) -> None:
    """Random rounds of random kept rows: the cache equals writing only the kept rows in order."""
    rng = random.Random(seed)
    kv = make(num_blocks=64, block_size=rng.choice([1, 2, 3, 4, 16]))
    kv.add(5)
    expect: list[float] = []
    tag = 0.0
    for _ in range(12):
        n = rng.randint(1, 12)
        tags = [tag + i for i in range(n)]
        tag += n
        write_rows(kv, 5, tags)
        keep = sorted(rng.sample(range(n), rng.randint(0, n)))
        kv.commit_rows(5, keep)
        expect += [tags[i] for i in keep]
        assert cached_tags(kv, 5) == expect
        assert kv.blocks_in_use == -(-len(expect) // kv.block_size)


def test_exhaustion_raises_before_changing_anything() -> None:
    kv = make(num_blocks=4, block_size=4)
    kv.add(0)
    kv.add(1)
    write_rows(kv, 0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    kv.commit_rows(0, range(6))
    write_rows(kv, 1, [9.0])
    before = (kv.k.clone(), kv.v.clone(), kv.block_table(0), kv.block_table(1), kv.num_free_blocks)
    assert not kv.can_fit(0, 7) and kv.can_fit(0, 6)
    with pytest.raises(KVCacheFull, match=r"2 more block\(s\) needed but only 1 free"):
        kv.reserve([(0, 7), (1, 1)])
    after = (kv.k, kv.v, kv.block_table(0), kv.block_table(1), kv.num_free_blocks)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2:] == after[2:]
    assert kv.scratch_len(1) == 1  # the other sequence's scratch survives
    kv.commit_rows(1, [0])
    assert cached_tags(kv, 0) == [1, 2, 3, 4, 5, 6] and cached_tags(kv, 1) == [9]


def test_discard_and_truncate() -> None:
    kv = make(num_blocks=8, block_size=2)
    kv.add(3)
    write_rows(kv, 3, [1.0, 2.0, 3.0])
    kv.commit_rows(3, range(3))
    write_rows(kv, 3, [4.0, 5.0, 6.0, 7.0])
    assert kv.blocks_in_use == 4
    kv.discard(3)
    assert kv.blocks_in_use == 2 and kv.cached_len(3) == 3
    kv.truncate(3, 1)
    assert cached_tags(kv, 3) == [1] and kv.blocks_in_use == 1


def test_bad_keep_lists_are_refused() -> None:
    kv = make()
    kv.add(0)
    write_rows(kv, 0, [1.0, 2.0, 3.0])
    for keep in ([1, 0], [0, 0], [3], [-1]):
        with pytest.raises(ValueError):
            kv.commit_rows(0, keep)
    assert kv.scratch_len(0) == 3 and kv.cached_len(0) == 0
    with pytest.raises(ValueError):
        kv.add(0)
    with pytest.raises(ValueError):
        kv.reserve([(0, 1), (0, 1)])


def test_contiguous_sequences_read_as_views_and_fragmented_ones_gather() -> None:
    kv = make(num_blocks=16, block_size=2)
    kv.add(0)
    write_rows(kv, 0, [1.0, 2.0, 3.0])
    (plan,) = kv.reserve([(0, 3)])
    assert isinstance(plan.read, tuple)  # one run of blocks: a view of the pool
    kv.commit_rows(0, range(3))
    # interleave several sequences until sequence 0's next block is taken
    for s in range(1, 8):
        kv.add(s)
        write_rows(kv, s, [50.0 + s] * 2)
        kv.commit_rows(s, range(2))
    grow = 12
    write_rows(kv, 0, [10.0 + i for i in range(grow)])
    (plan,) = kv.reserve([(0, grow)])
    assert isinstance(plan.read, torch.Tensor)  # its blocks are no longer one run: gathered
    assert read_tags(kv, 0) == [1, 2, 3] + [10.0 + i for i in range(grow)]
    kv.commit_rows(0, range(grow))
    assert cached_tags(kv, 0) == [1, 2, 3] + [10.0 + i for i in range(grow)]
    for s in range(1, 8):
        assert cached_tags(kv, s) == [50.0 + s] * 2


def test_reused_blocks_do_not_leak_old_rows() -> None:
    kv = make(num_blocks=2, block_size=4)
    kv.add(0)
    write_rows(kv, 0, [1.0] * 8)
    kv.free(0)
    kv.add(1)
    write_rows(kv, 1, [2.0, 3.0])
    kv.commit_rows(1, [1])
    assert cached_tags(kv, 1) == [3.0]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_a_pool_takes_memory_as_its_blocks_are_written_not_when_made() -> None:
    """A pool sized from the machine's memory must not hold it all from the start: a 1.5 GB pool
    costs the process only the pages its written blocks touch, and reads as zeros elsewhere."""
    before = _rss_bytes()
    kv = PagedKVCache(
        num_layers=4, num_kv_heads=2, head_dim=64, num_blocks=12288, block_size=16, tiled_keys=True
    )
    assert 3 * kv.k.numel() * 4 >= 1 << 30  # k, v and the tiled k
    made = _rss_bytes()
    assert made - before < 64 << 20, (made - before) / 2**20
    kv.k[:, :, :32] = 1.0  # two blocks written in every layer and head
    assert _rss_bytes() - before < 64 << 20
    assert not bool(kv.k[:, :, 32:].any()) and not bool(kv.v.any()) and bool(kv.k[:, :, :32].all())
    assert kv.kt is not None and not bool(kv.kt.any())
