"""torch drafter: the reference backend, built on the cloud runtime's model code.

Clarity over speed. The committed sequence lives in a paged KV cache (one sequence); each `extend`
re-runs the WHOLE workspace as one tree-masked forward (every node attends to the cached prefix,
its ancestors and itself, exactly the verifier's tree forward) and returns the new nodes' rows;
the scratch rows are then discarded, so the workspace itself is never cached. `sync` keeps the
longest cached prefix and evaluates the rest (an accepted path included) causally.

Models: anything `shared.model.load_target` loads (`tiny`, `smollm2-135m`, a .gguf file, a
safetensors directory) and the draft aliases of edge_client.models (their GGUF, dequantized to
fp32), so `torch` and `llama_cpp` can be compared on the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_client.drafters.base import Drafter
from edge_client.models import DRAFT_ALIASES, resolve_draft
from edge_client.stored_tokenizer import byte_decoder, plain_text_copy
from edge_client.tokenizer import EdgeTokenizer
from shared.model import SeqInput, load_target
from shared.model_store.trained import find_trained

BLOCK = 16
_SEQ = 0  # the one KV-cache sequence of this drafter


class TargetTokenizerAdapter(EdgeTokenizer):
    """The cloud runtime's tokenizer seen through the edge interface (bytes out, specials known)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.vocab_size = int(tok.vocab_size)
        self.eos_ids = tuple(int(i) for i in tok.eos_ids)
        self.bos_id = tok.bos_id
        self.chat_template = tok.chat_template
        added = tok.tokenizer.get_added_tokens_decoder()
        self._special = {int(i) for i, t in added.items() if t.special}
        from tokenizers import decoders

        self._bytes = byte_decoder() if isinstance(tok.tokenizer.decoder, decoders.ByteLevel) else None
        self._plain_tok: Any = None  # built on the first raw prompt (special-token texts as text)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not parse_special:
            if self._plain_tok is None:
                self._plain_tok = plain_text_copy(self._tok.tokenizer)
            return list(self._plain_tok.encode(text, add_special_tokens=add_special).ids)
        return list(self._tok.encode(text, add_special=add_special))

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} is out of range [0, {self.vocab_size})")
        text = self._tok.token_text(token)
        if token in self._special:
            return text.encode("utf-8") if special else b""
        if self._bytes is not None and all(ch in self._bytes for ch in text):
            return bytes(self._bytes[ch] for ch in text)
        return str(self._tok.decode([token])).encode("utf-8")

    def token_texts(self) -> list[bytes]:
        return [t.encode("utf-8") for t in self._tok.token_texts()]


def _target_name(model: str | Path) -> str:
    name = str(model)
    return str(resolve_draft(name)) if name in DRAFT_ALIASES or find_trained(name) else name


class TorchDrafter(Drafter):
    """A draft model in torch (fp32 on the CPU by default).

    model:       target alias / path for load_target, or a draft alias (its GGUF, dequantized)
    n_threads:   torch intra-op threads (a process-wide setting: benches pin the edge to 1)
    max_context, max_nodes, max_leaves: as for every drafter (see base.Drafter); the KV pool is
                 sized for max_context + max_nodes rows
    """

    name = "torch"

    def __init__(
        self,
        model: str | Path = "tiny",
        *,
        dtype: str = "float32",
        device: str = "cpu",
        n_threads: int | None = None,
        max_context: int = 4096,
        max_nodes: int = 256,
        max_leaves: int = 255,
        progress: bool = False,
    ) -> None:
        super().__init__()
        if n_threads:
            torch.set_num_threads(n_threads)
        self.model_id = str(model)
        self._target: Any = load_target(_target_name(model), dtype=dtype, device=device, progress=progress)
        self.vocab_size = int(self._target.config.vocab_size)
        self.max_context = max_context
        self.max_nodes = max_nodes
        self.max_leaves = max_leaves
        self.tokenizer = TargetTokenizerAdapter(self._target.tokenizer)
        blocks = math.ceil((max_context + max_nodes) / BLOCK) + 1
        self._kv: Any = self._target.new_kv_cache(blocks, BLOCK)
        self._kv.add(_SEQ)

    def vocab_fingerprint(self) -> str:
        return str(self._target.vocab_fingerprint)

    # ------------------------------------------------------------------ hooks
    def _commit(self, keep: int, path: list[int], tail: list[int]) -> np.ndarray | None:
        kv = self._kv
        kv.discard(_SEQ)
        if keep < kv.cached_len(_SEQ):
            kv.truncate(_SEQ, keep)
        new = [self._tokens[n] for n in path] + tail  # accepted draft nodes are not cached here
        if not new:
            return None
        n = len(new)
        out = self._forward(new, np.arange(keep, keep + n), None, [n - 1])  # [1, V]
        kv.commit_rows(_SEQ, range(n))
        return out[0] if tail else None

    def _evaluate(self, first: int, count: int) -> np.ndarray:
        n = first + count
        parents = self._parents[:n]
        mask = np.eye(n, dtype=bool)  # [n, n] ancestor-or-self
        for i, p in enumerate(parents):
            if p >= 0:
                mask[i] |= mask[p]
        positions = self.committed_len - 1 + np.asarray(self._depths[:n], dtype=np.int64)
        try:
            return self._forward(self._tokens[:n], positions, mask, range(first, n))  # [count, V]
        finally:
            self._kv.discard(_SEQ)

    def _drop_workspace(self) -> None:
        self._kv.discard(_SEQ)

    # ------------------------------------------------------------------ internals
    def _forward(
        self,
        tokens: Sequence[int],
        positions: np.ndarray,
        tree_mask: np.ndarray | None,
        logit_rows: Sequence[int] | range,
    ) -> np.ndarray:
        inp = SeqInput(
            seq_id=_SEQ,
            tokens=torch.tensor(list(tokens), dtype=torch.int64),
            positions=torch.as_tensor(positions, dtype=torch.int64),
            tree_mask=None if tree_mask is None else torch.from_numpy(tree_mask),
            logit_rows=torch.tensor(list(logit_rows), dtype=torch.int64),
        )
        (out,) = self._target.model.forward_packed([inp], self._kv)  # [k, V]
        return np.ascontiguousarray(out.detach().to("cpu", torch.float32).numpy())

    def close(self) -> None:
        super().close()
        kv, self._kv = getattr(self, "_kv", None), None
        if kv is not None and _SEQ in kv.sequences():
            kv.free(_SEQ)
        self._target = None
