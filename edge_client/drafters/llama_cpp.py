"""llama.cpp drafter: a GGUF draft model, a token tree evaluated level by level, one llama_decode per level.

How a tree lives in llama.cpp's KV cache (facts checked on llama-cpp-python 0.3.36):

- One UNIFIED KV buffer (`kv_unified=True`) shared by all sequences. A cell holds one token's K/V
  and the SET of sequence ids it belongs to; a token attends to the cells of its own sequences at
  positions <= its own. `llama_memory_seq_cp` only adds a sequence id to existing cells (no K/V
  copy; with per-sequence buffers it would copy data).
- Sequence 0 is the committed sequence. Every workspace LEAF owns one more sequence holding the
  committed prefix and the leaf's root-to-leaf path, so `n_seq_max = max_leaves + 1` (<= 256).
- A child that continues its parent's sequence (the parent was that sequence's last token) just
  joins it; any other child FORKS: a free sequence id is copied from the parent's path
  (`seq_cp(src, new, -1, parent_pos + 1)`) and the child continues it. A sequence must continue at
  its `pos_max + 1`, which this scheme gives by construction.
- One batch entry may belong to several sequences, so a node whose children are added in the same
  call carries all their sequence ids: a shared prefix is evaluated once, in one llama_decode.
- `sync` keeps the accepted path by adding sequence 0 to its cells (`seq_cp` from the leaf's
  sequence), then `seq_keep(0)` frees every cell no longer in sequence 0.

Numerics: llama.cpp quantizes activations to 8 bits inside every quantized matmul, so a change in
summation order far below fp32 precision can flip a rounding step and move logits by up to ~0.7
(total variation ~1e-3). With the default (flash) attention path, a node's logits are bit-identical
to a fresh prefill of its path as long as its cells lie in position order; once freed cells of
dropped branches are reused, results agree only to that noise. Tests compare with a tolerance.
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path
from typing import Any

import llama_cpp as llama
import numpy as np

from edge_client.drafters.base import Drafter, DrafterError
from edge_client.llama_native import NativeModel
from edge_client.models import resolve_draft
from edge_client.tokenizer import LlamaCppTokenizer

LLAMA_MAX_SEQ = 256  # llama.cpp's compile-time limit on sequence ids per context


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class LlamaCppDrafter(Drafter):
    """A GGUF draft model run by llama.cpp on the CPU.

    model:       a draft alias (edge_client.models.DRAFT_ALIASES) or a GGUF path
    n_threads:   llama.cpp threads (benches pin the edge to 1); default min(4, cores)
    max_context: the longest committed sequence; the KV cache has max_context + max_nodes cells
    max_nodes:   workspace nodes between syncs (also the largest batch one extend may send)
    max_leaves:  workspace branches between syncs, at most 255 (one KV sequence each) and fewer than
                 a batch's rows (min(max(n_batch, max_nodes), max_context + max_nodes)); lowered to fit

    Not thread-safe: use it from one thread at a time (the client drafts on a worker thread).
    """

    name = "llama_cpp"

    def __init__(
        self,
        model: str | Path = "smollm2-135m-q4",
        *,
        n_threads: int | None = None,
        max_context: int = 4096,
        max_nodes: int = 256,
        max_leaves: int = LLAMA_MAX_SEQ - 1,
        n_batch: int = 512,
        lora: str | Path | None = None,
        lora_scale: float = 1.0,
    ) -> None:
        if not 1 <= max_leaves < LLAMA_MAX_SEQ:
            raise ValueError(f"max_leaves must be in [1, {LLAMA_MAX_SEQ - 1}] (llama.cpp's sequence limit)")
        if max_context < 1 or max_nodes < 1:
            raise ValueError("max_context and max_nodes must be positive")
        self._ctx: Any = None
        self._batch: Any = None
        self._model: NativeModel | None = None
        super().__init__()
        path = resolve_draft(model)
        self.model_id = str(model)
        self.path = path
        self.tokenizer = LlamaCppTokenizer(path)
        self._model = NativeModel(path)
        self.vocab_size = self._model.n_vocab
        self.max_context = max_context
        self.max_nodes = max_nodes
        self.n_threads = n_threads or default_threads()
        # llama.cpp aborts the process when a batch exceeds the context, or when it has more sequences
        # (one per leaf and the committed one) than a batch has rows: never ask for either
        self._n_batch = min(max(n_batch, max_nodes), max_context + max_nodes)
        self.max_leaves = min(max_leaves, self._n_batch - 1)
        params = llama.llama_context_default_params()
        params.n_ctx = max_context + max_nodes
        params.n_batch = self._n_batch
        params.n_ubatch = self._n_batch  # one level = one ubatch: no split of a level's batch
        params.n_seq_max = self.max_leaves + 1
        params.kv_unified = True
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads
        params.no_perf = True
        self._ctx = llama.llama_init_from_model(self._model.ptr, params)
        if not self._ctx:
            self.close()
            raise DrafterError(
                f"llama.cpp could not create a context of {max_context + max_nodes} tokens for {path}; "
                "lower max_context / max_nodes"
            )
        self.lora = None if lora is None else Path(lora)
        if self.lora is not None:
            self._apply_lora(self.lora, lora_scale)
        self._mem: Any = llama.llama_get_memory(self._ctx)
        self._batch = llama.llama_batch_init(self._n_batch, 0, self.max_leaves + 1)
        self._reset_seqs()

    def _apply_lora(self, path: Path, scale: float) -> None:
        """Load a LoRA adapter GGUF (`draft-training export --lora`) onto the model and apply it to
        this context with `scale` (llama.cpp frees it with the model)."""
        assert self._model is not None
        if not path.is_file():
            self.close()
            raise DrafterError(
                f"LoRA adapter not found: {path} (write one with `draft-training export --lora`)"
            )
        if not math.isfinite(scale):
            self.close()
            raise DrafterError(f"lora_scale must be a finite number, got {scale}")
        adapter = llama.llama_adapter_lora_init(self._model.ptr, str(path).encode())
        if not adapter:
            self.close()
            raise DrafterError(
                f"llama.cpp could not load the LoRA adapter {path} for {self.path}: is it an adapter GGUF "
                "of this draft's architecture and shapes?"
            )
        adapters = (llama.llama_adapter_lora_p_ctypes * 1)(adapter)
        scales = (ctypes.c_float * 1)(scale)
        if llama.llama_set_adapters_lora(self._ctx, adapters, 1, scales):
            self.close()
            raise DrafterError(f"llama.cpp could not apply the LoRA adapter {path}")

    # ------------------------------------------------------------------ hooks
    def _commit(self, keep: int, path: list[int], tail: list[int]) -> np.ndarray | None:
        if path:
            # the accepted path joins sequence 0: positions keep .. keep + len(path) - 1
            llama.llama_memory_seq_cp(self._mem, self._node_seq[path[-1]], 0, keep, keep + len(path))
        llama.llama_memory_seq_keep(self._mem, 0)
        if keep < self.committed_len:
            llama.llama_memory_seq_rm(self._mem, 0, keep, -1)
        self._reset_seqs()
        if not tail:
            return None
        start = keep + len(path)
        out: np.ndarray | None = None
        for a in range(0, len(tail), self._n_batch):
            chunk = tail[a : a + self._n_batch]
            last = a + len(chunk) == len(tail)
            b = self._batch
            b.n_tokens = len(chunk)
            for j, tok in enumerate(chunk):
                b.token[j] = tok
                b.pos[j] = start + a + j
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = 0
                b.logits[j] = 1 if (last and j == len(chunk) - 1) else 0
            self._decode()
            if last:
                out = self._row(len(chunk) - 1).copy()
        return out

    def _evaluate(self, first: int, count: int) -> np.ndarray:
        base = self.committed_len  # position of a node = base - 1 + depth
        parents, depths = self._parents, self._depths
        entry_seqs: list[list[int]] = [[] for _ in range(count)]
        for i in range(first, first + count):
            p = parents[i]
            if p >= 0 and self._tip.get(self._node_seq[p]) == p:
                seq = self._node_seq[p]  # p ends its sequence: continue it
            else:
                seq = self._fork(p, first, entry_seqs)
            self._node_seq.append(seq)
            self._tip[seq] = i
            entry_seqs[i - first].append(seq)
        b = self._batch
        b.n_tokens = count
        for j in range(count):
            i = first + j
            b.token[j] = self._tokens[i]
            b.pos[j] = base - 1 + depths[i]
            seqs = entry_seqs[j]
            b.n_seq_id[j] = len(seqs)
            for k, s in enumerate(seqs):
                b.seq_id[j][k] = s
            b.logits[j] = 1
        self._decode()
        out = np.empty((count, self.vocab_size), dtype=np.float32)  # [count, V]
        for j in range(count):
            out[j] = self._row(j)
        return out

    def _drop_workspace(self) -> None:
        if self._ctx:
            llama.llama_memory_seq_keep(self._mem, 0)
        self._reset_seqs()

    # ------------------------------------------------------------------ internals
    def _reset_seqs(self) -> None:
        self._node_seq: list[int] = []  # [num_nodes] the sequence each node was added on
        self._tip: dict[int, int] = {}  # sequence -> its last node
        self._free_seqs = list(range(self.max_leaves, 0, -1))

    def _fork(self, parent: int, first: int, entry_seqs: list[list[int]]) -> int:
        """A new sequence holding the committed prefix and the path down to `parent`."""
        if not self._free_seqs:
            raise DrafterError("no free KV sequence (the leaf count check should have caught this)")
        seq = self._free_seqs.pop()
        q = parent
        while q >= first:  # ancestors evaluated in this call get the new id in their batch entry
            entry_seqs[q - first].append(seq)
            q = self._parents[q]
        src = 0 if q < 0 else self._node_seq[q]
        # cells at positions [0, pos(q) + 1): the committed prefix and q's path
        llama.llama_memory_seq_cp(self._mem, src, seq, -1, self.committed_len + self.node_depth(q))
        return seq

    def _decode(self) -> None:
        rc = int(llama.llama_decode(self._ctx, self._batch))
        if rc != 0:
            raise DrafterError(f"llama_decode returned {rc} (1: no room in the KV cache, <0: error)")

    def _row(self, j: int) -> np.ndarray:
        ptr = llama.llama_get_logits_ith(self._ctx, j)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))

    def close(self) -> None:
        super().close()
        batch, self._batch = self._batch, None
        if batch is not None:
            llama.llama_batch_free(batch)
        ctx, self._ctx = self._ctx, None
        if ctx:
            llama.llama_free(ctx)
        model, self._model = self._model, None
        if model is not None:
            model.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown may have torn down llama_cpp already
            pass
