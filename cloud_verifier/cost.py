"""The verify cost curve: forward milliseconds for N tree nodes, measured at start-up.

The server advertises it in `welcome.verify_cost_ms`; the edge sizes its trees by it (more nodes
while a node costs little, DESIGN section 6).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from cloud_verifier.kv_cache import PagedKVCache
from cloud_verifier.model import SeqInput, Target
from shared.tree import TokenTree

DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64)
_PROBE_SEQ = -7  # a sequence id no session uses


def probe_tree(n: int, base: int, vocab: int) -> TokenTree:
    """A fixed tree of n nodes with the width-4 shape typical of drafted trees."""
    rng = np.random.default_rng(n)
    parents = [-1] + [int(rng.integers(max(-1, i - 4), i)) for i in range(1, n)]
    return TokenTree.build(rng.integers(0, vocab, n), parents, base=base)


def measure_verify_cost(
    target: Target,
    kv: PagedKVCache,
    nodes: Sequence[int] = DEFAULT_NODES,
    prefix: int = 64,
    repeats: int = 3,
) -> dict[int, float]:
    """Median forward ms for each N at a committed prefix of `prefix` tokens (row 0 + N nodes)."""
    dev = target.device
    vocab = target.config.vocab_size
    out: dict[int, float] = {}
    kv.add(_PROBE_SEQ)
    try:
        with torch.inference_mode():
            pre = torch.randint(0, vocab, (prefix,), generator=torch.Generator().manual_seed(0))
            target.model.forward_packed(
                [
                    SeqInput(
                        _PROBE_SEQ,
                        pre.to(dev),
                        torch.arange(prefix).to(dev),
                        None,
                        torch.zeros(0, dtype=torch.long).to(dev),
                    )
                ],
                kv,
            )
            kv.commit_rows(_PROBE_SEQ, list(range(prefix - 1)))
            for n in nodes:
                tree = probe_tree(n, prefix, vocab)
                rows = torch.tensor([int(pre[-1]), *tree.tokens.tolist()], dtype=torch.long)
                pos = torch.cat(
                    [torch.tensor([prefix - 1]), torch.from_numpy(tree.positions.astype(np.int64))]
                )
                mask = torch.from_numpy(tree.row_mask())
                inp = SeqInput(
                    _PROBE_SEQ, rows.to(dev), pos.to(dev), mask.to(dev), torch.arange(n + 1).to(dev)
                )
                times = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    target.model.forward_packed([inp], kv)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    times.append((time.perf_counter() - t0) * 1e3)
                    kv.discard(_PROBE_SEQ)
                out[n] = round(statistics.median(times[1:]), 3)  # the first run warms up
    finally:
        kv.free(_PROBE_SEQ)
    return out
