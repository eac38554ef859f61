"""`ShardedKVCache`: rank 0's paged KV cache, whose every mutation is sent to the other ranks.

Each rank keeps its own PagedKVCache holding its KV heads, with the SAME block tables. Every
KV-mutating call (add, free, discard, truncate, commit_rows; reserve and write happen inside the
forward on every rank) is therefore applied in one order on every rank, and block allocation,
being deterministic, gives the same tables. The engine frees and adds sessions on its event-loop
thread while a forward runs on its worker thread: those calls are applied to rank 0's bookkeeping
at once but sent after the forward, and a freed session's blocks return to rank 0's free list
only then, so that the forward's allocation sees on every rank the free list it saw on rank 0.
`cache_digest` and `ranks_agree` check that every rank's bookkeeping equals rank 0's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from cloud_verifier.parallel.group import TPGroup
from cloud_verifier.parallel.protocol import Op, TensorParallelError
from shared.model.kv_cache import PagedKVCache


class ShardedKVCache(PagedKVCache):
    """Rank 0's KV cache (its KV heads): every mutation is sent to the other ranks, whose caches
    apply it in the same order (see the module doc for calls made while a forward runs)."""

    def __init__(self, group: TPGroup, cache_id: int, local: PagedKVCache) -> None:
        # adopt the freshly made local pool's state (no second allocation)
        self.__dict__.update(local.__dict__)
        self.group = group
        self.cache_id = cache_id
        weakref.finalize(self, group.dropped.append, cache_id)

    def _mutate(
        self, op: Op, args: Sequence[int], apply: Callable[[], None], ints: Sequence[int] = ()
    ) -> None:
        g = self.group
        with g.lock:
            while g.forwarding and op not in (Op.ADD, Op.FREE):
                g.idle.wait()  # (the engine never does this during a forward; other callers wait)
            if g.forwarding:
                self._defer(op, args)
                return
            apply()  # raises before anything is sent when the call is refused
            if g.error is None:
                # a failed send has marked the group broken (logged, /readyz 503); the engine's
                # bookkeeping on this rank stays right, so the caller is not interrupted
                with contextlib.suppress(TensorParallelError):
                    g.send(op, self.cache_id, args, ints)

    def _defer(self, op: Op, args: Sequence[int]) -> None:
        g, sid = self.group, args[0]
        if op is Op.ADD:
            PagedKVCache.add(self, sid)
            g.deferred.append((lambda: None, op, self.cache_id, list(args)))
            return
        # free: forget the sequence now, but keep its blocks off the free list until the forward
        # is over, as on the other ranks (which free it after the forward)
        seq = self._seq(sid)
        del self._seqs[sid]
        blocks = list(seq.blocks)
        g.deferred.append((lambda: self._release(blocks), op, self.cache_id, list(args)))

    def add(self, seq_id: int) -> None:
        self._mutate(Op.ADD, (seq_id,), lambda: PagedKVCache.add(self, seq_id))

    def free(self, seq_id: int) -> None:
        self._mutate(Op.FREE, (seq_id,), lambda: PagedKVCache.free(self, seq_id))

    def discard(self, seq_id: int) -> None:
        self._mutate(Op.DISCARD, (seq_id,), lambda: PagedKVCache.discard(self, seq_id))

    def truncate(self, seq_id: int, length: int) -> None:
        self._mutate(Op.TRUNCATE, (seq_id, length), lambda: PagedKVCache.truncate(self, seq_id, length))

    def commit_rows(self, seq_id: int, keep: Sequence[int]) -> None:
        idx = [int(i) for i in keep]
        self._mutate(Op.COMMIT_ROWS, (seq_id,), lambda: PagedKVCache.commit_rows(self, seq_id, idx), idx)

    def consistent(self) -> bool:
        """Whether every rank's cache has rank 0's sequences, lengths, block tables and free list."""
        g = self.group
        with g.lock:
            while g.forwarding:
                g.idle.wait()
            g.send(Op.CHECK_CACHE, self.cache_id, ints=cache_digest(self))
            return ranks_agree(g, True)


def cache_digest(kv: PagedKVCache) -> list[int]:
    """The bookkeeping every rank must share: free blocks, then (seq, cached, scratch, blocks...)."""
    out = [kv.num_free_blocks, len(kv.sequences())]
    for sid in sorted(kv.sequences()):
        table = kv.block_table(sid)
        out += [sid, kv.cached_len(sid), kv.scratch_len(sid), len(table), *table]
    return out


def ranks_agree(g: TPGroup, ok: bool) -> bool:
    """Every rank's verdict: True when all say so."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=g.device)
    g._collective("cache check", lambda: dist.all_reduce(flag, group=g.step))
    return int(flag) == 0
