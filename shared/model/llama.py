"""Llama-family decoder with a packed tree-attention forward (SpecInfer's tree-based parallel decoding).

One `forward_packed` call serves every ready sequence of an engine step: tree rounds (row 0 + the
tree's nodes, attention limited by the topology-aware mask), chunked prefills (causal) and
single-token decode steps. The rows of all sequences are concatenated so each weight matrix is
read once per step for all of them (on a memory-bound device that is the whole point: verifying
N rows costs about one decode step); only attention runs per sequence, over that sequence's paged
KV cache. Projections are fused (q|k|v and gate|up) to halve the number of matmul launches, and
the LM head runs only on the rows whose logits are asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.model import attention, gemm
from shared.model.attention import ATTENTION_MODES
from shared.model.inputs import SeqInput, check_input, row_bounds
from shared.model.kv_cache import TILE, PagedKVCache
from shared.model.model_config import ModelConfig
from shared.model.rope import Rotary
from treespec_kernels import cpu_attention

# SeqInput and check_input are part of this module's interface (the sharded model imports them here)
__all__ = ["ATTENTION_MODES", "DecoderLayer", "LlamaModel", "SeqInput", "check_input", "rms_norm"]


class DecoderLayer(nn.Module):
    """Weights of one block; the computation lives in LlamaModel so the loop stays flat."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, qkv = config.hidden_size, config.q_size + 2 * config.kv_size
        self.attn_norm = nn.Parameter(torch.empty(h, dtype=dtype, device=device))  # [hidden]
        self.qkv = nn.Parameter(torch.empty(qkv, h, dtype=dtype, device=device))  # [q + 2 kv, hidden]
        self.qkv_bias = (
            nn.Parameter(torch.empty(qkv, dtype=dtype, device=device)) if config.qkv_bias else None
        )  # [q + 2 kv]
        self.o = nn.Parameter(torch.empty(h, config.q_size, dtype=dtype, device=device))  # [hidden, q]
        self.mlp_norm = nn.Parameter(torch.empty(h, dtype=dtype, device=device))  # [hidden]
        self.gate_up = nn.Parameter(
            torch.empty(2 * config.intermediate_size, h, dtype=dtype, device=device)
        )  # [2 inter, hidden]
        self.down = nn.Parameter(
            torch.empty(h, config.intermediate_size, dtype=dtype, device=device)
        )  # [hidden, inter]


@dataclass(frozen=True)
class _Prepared:
    """Per-layer projection weights in the Gemm's prepared form (see gemm.py)."""

    gemm: gemm.Gemm
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # qkv, o, gate_up, down
    lm_head: torch.Tensor


class LlamaModel(nn.Module):
    """The decoder. Weights are read-only once a forward has run: the first forward prepares
    (packs) the projection weights; call `set_gemm` after changing weights in place.

    Attention: `set_attention(mode)` with one of ATTENTION_MODES chooses a backend of
    attention.py once ("model": the Triton kernel on a GPU with Triton, the batch-invariant CPU
    kernel for float32 on a CPU, else SDPA; "sdpa", "triton" force one; "float64" keeps the KV
    cache and SDPA in float64, which makes a tree node's logits agree bit for bit with decoding its
    path, on any device, at 10-80% more per forward). With the CPU kernel and oneDNN's row-invariant
    projections they agree bit for bit at SDPA's speed; SDPA in float32 leaves up to a few 1e-4 of
    logit noise between a tree row and the same token decoded alone (SmolLM2-135M).
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, gemm_kind: str = "auto"
    ) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )  # [vocab, hidden]
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device))  # [hidden]
        # [vocab, hidden]; the same Parameter as `embed` when the embeddings are tied
        self.lm_head = (
            self.embed
            if config.tie_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        )
        self.rotary = Rotary(config, device)
        self.requires_grad_(False)
        self.gemm_kind = gemm_kind
        self._prepared: _Prepared | None = None
        self.released = False  # projections freed after packing (see prepare)
        self.attn_dtype = dtype
        self._mode = "model"  # one of ATTENTION_MODES
        self._backend: attention.AttentionBackend | None = None  # chosen from the mode on first use
        # tensor parallelism (cloud_verifier.parallel) sums a layer's partial o / down output over the ranks
        # in place, and gathers the vocab-parallel head's logit shards; None on one process
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_attention(self, mode: str) -> None:
        """One of ATTENTION_MODES (see the class doc). Caches made before the switch still
        work (converted per layer, or through SDPA when they lack the kernel's tiled keys), at a cost."""
        attention.check_mode(self, mode)
        self.attn_dtype = torch.float64 if mode == "float64" else self.dtype
        self._mode = mode
        self._backend = None

    @property
    def attention_mode(self) -> str:
        if self._mode == "float64" and self.dtype == torch.float64:
            return "model"
        return self._mode

    @property
    def attention_backend(self) -> attention.AttentionBackend:
        """The backend the mode chose (attention.choose), chosen once."""
        if self._backend is None:
            self._backend = attention.choose(self, self._mode)
        return self._backend

    @property
    def attention_kernel(self) -> str:
        """What computes attention: "cpu-invariant" (the kernel), "triton" or "sdpa"."""
        return self.attention_backend.name

    def _norm(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """RMSNorm (h [T, hidden], weight) -> [T, hidden]: the one-pass CPU kernel for float32 on
        a CPU when it is built (row-invariant like F.rms_norm, one op instead of six), else torch."""
        c = self.config
        eps, shape = c.rms_norm_eps, (c.hidden_size,)
        if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_attention.load() is not None:
            return lambda h, w: cpu_attention.rms_norm(h, w, eps)
        return lambda h, w: rms_norm(h, shape, w, eps)

    def set_gemm(self, kind: str) -> None:
        """Choose the projection kernels ("auto", "onednn", "torch"); re-prepares lazily."""
        self._check_weights("set_gemm")
        gemm.choose(kind, self.device, self.dtype)
        self.gemm_kind = kind
        self._prepared = None

    def prepare(self, release: bool = False, progress: bool = False) -> _Prepared:
        """Pack the projection weights for the chosen kernels (once; forwards call this).

        release: when the packed form is a copy (oneDNN), free each original projection right after
        packing it, so the model holds one copy of its weights instead of two (the 1.5B: 7.1 instead
        of 13.3 GB). Afterwards the projections exist only packed: `set_gemm` and reading the
        weights (`hf_state_dict`) refuse. The embedding table stays (the lookup needs it).
        """
        if self._prepared is None:
            from tqdm import tqdm

            g = gemm.Gemm(gemm.choose(self.gemm_kind, self.device, self.dtype))
            release = release and g.kind == "onednn"
            layers = []
            for layer in tqdm(self.layers, desc="packing weights", unit="layer", disable=not progress):
                assert isinstance(layer, DecoderLayer)
                packed = (g.pack(layer.qkv), g.pack(layer.o), g.pack(layer.gate_up), g.pack(layer.down))
                layers.append(packed)
                if release:
                    for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
                        p.data = p.data.new_empty(0)
            head = g.pack(self.lm_head)
            if release and self.lm_head is not self.embed:
                self.lm_head.data = self.lm_head.data.new_empty(0)
            self._prepared = _Prepared(g, layers, head)
            self.released = self.released or release
        return self._prepared

    def _check_weights(self, what: str) -> None:
        if self.released:
            raise RuntimeError(
                f"{what}: this model's projection weights were released after packing "
                "(prepare(release=True)); load it again to change or read them"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        """A pool for this model; with the CPU kernel in use (and a block size that is a multiple
        of 16) it also keeps the kernel's tiled keys."""
        c = self.config
        tiled = self.attention_kernel == "cpu-invariant" and block_size % TILE == 0
        return PagedKVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            num_blocks,
            block_size,
            self.attn_dtype,
            self.device,
            tiled_keys=tiled,
        )

    @torch.inference_mode()
    def forward_packed(self, inputs: list[SeqInput], kv: PagedKVCache) -> list[torch.Tensor]:
        """Run the rows of several sequences in one pass; per input, [k, vocab] float32 logits.

        The new rows' K/V are written to each sequence's scratch slots (uncommitted until the
        engine calls `kv.commit_rows`); a pool too small for them raises KVCacheFull before
        anything is written.
        """
        if not inputs:
            return []
        c = self.config
        for x in inputs:
            check_input(x, c.vocab_size)
        plans = kv.reserve([(x.seq_id, x.num_rows) for x in inputs])
        cached = [kv.cached_len(x.seq_id) for x in inputs]
        bounds = row_bounds(inputs)
        rows = attention.ForwardRows(inputs, cached, plans, bounds)
        attend = attention.for_pool(self.attention_backend, kv).prepare(self, rows, kv)
        tokens = torch.cat([x.tokens for x in inputs]).to(self.device)  # [T]
        positions = torch.cat([x.positions for x in inputs]).to(self.device)  # [T]
        write_slots = torch.cat([p.write for p in plans])  # [T]
        cos, sin = self.rotary.tables(positions, self.dtype)  # [T, 1, head_dim] each
        prep = self.prepare()
        lin = prep.gemm.linear
        h = F.embedding(tokens, self.embed)  # [T, hidden]
        t, hd, inter = h.shape[0], c.head_dim, c.intermediate_size
        qk_heads = c.num_heads + c.num_kv_heads
        norm = self._norm()
        for li, (layer, (w_qkv, w_o, w_gu, w_down)) in enumerate(zip(self.layers, prep.layers, strict=True)):
            assert isinstance(layer, DecoderLayer)
            qkv = lin(norm(h, layer.attn_norm), w_qkv, layer.qkv_bias)  # [T, q + 2 kv]
            qk = self.rotary.apply(qkv[:, : qk_heads * hd].view(t, qk_heads, hd), cos, sin)
            kv.write(
                li, write_slots, qk[:, c.num_heads :], qkv[:, qk_heads * hd :].view(t, c.num_kv_heads, hd)
            )
            o = attend(qk[:, : c.num_heads], li)  # [T, heads * head_dim]
            out = lin(o, w_o)  # [T, hidden]
            if self.all_reduce is not None:
                self.all_reduce(out)
            h += out
            gu = lin(norm(h, layer.mlp_norm), w_gu)  # [T, 2 inter]
            out = lin(F.silu(gu[:, :inter]) * gu[:, inter:], w_down)
            if self.all_reduce is not None:
                self.all_reduce(out)
            h += out
        return self._logits(h, inputs, bounds)

    def _logits(
        self, h: torch.Tensor, inputs: list[SeqInput], bounds: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """h: [T, hidden] -> per input [k, vocab] float32: the final norm and LM head on wanted rows only."""
        rows = torch.cat([x.logit_rows.to(self.device) + a for x, (a, _) in zip(inputs, bounds, strict=True)])
        counts = [int(x.logit_rows.numel()) for x in inputs]
        if rows.numel() == 0:
            return [torch.empty(0, self.config.vocab_size, device=self.device) for _ in inputs]
        x = self._norm()(h.index_select(0, rows), self.norm)
        prep = self.prepare()
        logits = prep.gemm.linear(x, prep.lm_head).float()  # [sum k, vocab]
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        return list(logits.split(counts))


def rms_norm(h: torch.Tensor, shape: tuple[int], weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h: [T, hidden]. Normalised in float32 even for bf16/fp16 weights, as the checkpoints were trained."""
    if h.dtype == torch.float32:
        return F.rms_norm(h, shape, weight, eps)
    return F.rms_norm(h.float(), shape, weight.float(), eps).to(h.dtype)
