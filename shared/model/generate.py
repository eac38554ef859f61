"""Target-only greedy decoding on the packed forward: the cloud-only baseline and a test oracle."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.model.inputs import decode_step, prefill_chunk
from shared.model.kv_cache import PagedKVCache
from shared.model.llama import LlamaModel


def prefill(
    model: LlamaModel, kv: PagedKVCache, seq_id: int, tokens: Sequence[int], chunk: int = 512
) -> torch.Tensor:
    """Commit `tokens` after the sequence's cache in causal chunks; [vocab] logits of the last one."""
    if not tokens:
        raise ValueError("prefill needs at least one token")
    logits = torch.empty(0)
    for a in range(0, len(tokens), chunk):
        part = tokens[a : a + chunk]
        (logits,) = model.forward_packed([prefill_chunk(seq_id, part, kv.cached_len(seq_id))], kv)
        kv.commit_rows(seq_id, range(len(part)))
    return logits[0]


def greedy_generate(
    model: LlamaModel,
    kv: PagedKVCache,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    seq_id: int = 0,
) -> list[int]:
    """Greedy continuation of `prompt` (one forward per token), ending after an EOS id.

    The sequence is added to `kv` and freed again at the end.
    """
    kv.add(seq_id)
    try:
        logits = prefill(model, kv, seq_id, prompt)
        out: list[int] = []
        stop = set(eos_ids)
        while True:
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok in stop or len(out) >= max_new_tokens:
                return out
            (row,) = model.forward_packed([decode_step(seq_id, tok, kv.cached_len(seq_id))], kv)
            kv.commit_rows(seq_id, (0,))
            logits = row[0]
    finally:
        kv.free(seq_id)
