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

from shared.model import gemm, triton_attention
from shared.model.config import ModelConfig
from shared.model.inputs import SeqInput, allowed_rows, attention_mask, check_input, row_bounds
from shared.model.kv_cache import TILE, PagedKVCache, SeqSlots
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


ATTENTION_MODES = ("model", "float64", "sdpa", "triton")


class LlamaModel(nn.Module):
    """The decoder. Weights are read-only once a forward has run: the first forward prepares
    (packs) the projection weights; call `set_gemm` after changing weights in place.

    Attention: "model" computes attention in the weights' dtype; for float32 on a CPU it uses the
    batch-invariant kernel of treespec_kernels/cpu_attention.py (every sum in an order fixed by key
    position), so
    with oneDNN's row-invariant projections a tree node's logits are bit-identical to decoding
    its path token by token, at SDPA's speed. Elsewhere (GPU, bf16/fp16, no compiler) "model" is
    SDPA with the tree mask, except on a GPU with Triton installed, where it is the Triton tree-attention
    kernel (model/triton_attention.py: one launch per layer for every sequence, keys read through
    the block tables). "triton" forces that kernel (on a CPU it runs in Triton's interpreter, slowly:
    tests). "sdpa" forces SDPA (on SmolLM2-135M fp32 it leaves up to a few 1e-4
    of logit noise between a tree row and the same token decoded alone). "float64" keeps the KV
    cache and SDPA in float64, which also makes the rows agree bit for bit, on any device, at
    10-80% more per forward.
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
        self._sdpa = False  # "sdpa" mode: never the CPU kernel
        self._triton = False  # "triton" mode: the Triton kernel on any device (CPU: interpreted)
        # tensor parallelism (cloud_verifier.parallel) sums a layer's partial o / down output over the ranks
        # in place, and gathers the vocab-parallel head's logit shards; None on one process
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_attention(self, mode: str) -> None:
        """ "model", "sdpa" or "float64" (see the class doc). Caches made before the switch still
        work (converted per layer, or through SDPA when they lack the kernel's tiled keys), at a cost."""
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
        if mode == "triton" and not triton_attention.supports(self.dtype, self.config.head_dim):
            raise ValueError(
                f"attention 'triton' serves float16/bfloat16/float32 and head_dim in "
                f"{triton_attention.HEAD_DIMS}; this model is {self.dtype}, head_dim {self.config.head_dim}"
            )
        if mode == "triton" and not triton_attention.installed():
            raise ValueError("attention 'triton' needs Triton: pip install 'treespec[gpu]'")
        self.attn_dtype = torch.float64 if mode == "float64" else self.dtype
        self._sdpa = mode == "sdpa"
        self._triton = mode == "triton"

    @property
    def attention_mode(self) -> str:
        if self.attn_dtype == torch.float64 and self.dtype != torch.float64:
            return "float64"
        if self._triton:
            return "triton"
        return "sdpa" if self._sdpa else "model"

    @property
    def attention_kernel(self) -> str:
        """What computes attention: "cpu-invariant" (the kernel), "triton" or "sdpa"."""
        if self._use_triton():
            return "triton"
        return "cpu-invariant" if self._use_kernel() else "sdpa"

    def _use_triton(self) -> bool:
        """The Triton kernel: asked for ("triton"), or "model" on a GPU where Triton is installed."""
        if self._triton:
            return True
        c = self.config
        return (
            not self._sdpa
            and self.attn_dtype == self.dtype
            and triton_attention.available(self.device, self.dtype, c.head_dim)
        )

    def _norm(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """RMSNorm (h [T, hidden], weight) -> [T, hidden]: the one-pass CPU kernel for float32 on
        a CPU when it is built (row-invariant like F.rms_norm, one op instead of six), else torch."""
        c = self.config
        eps, shape = c.rms_norm_eps, (c.hidden_size,)
        if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_attention.load() is not None:
            return lambda h, w: cpu_attention.rms_norm(h, w, eps)
        return lambda h, w: rms_norm(h, shape, w, eps)

    def _use_kernel(self) -> bool:
        c = self.config
        return (
            not self._sdpa
            and not self._triton
            and self.attn_dtype == self.dtype
            and cpu_attention.supports(c.head_dim, self.dtype, self.device)
            and cpu_attention.load() is not None
        )

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
        tiled = self._use_kernel() and block_size % TILE == 0
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
        kernel = kv.kt is not None and self._use_kernel()
        triton = not kernel and self._use_triton()
        masks: list[torch.Tensor | None] = []
        kernel_args: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        launch: triton_attention.LaunchArgs | None = None
        if triton:  # one launch per layer for all sequences; over-long tree sessions through SDPA
            launch = triton_attention.prepare(inputs, cached, kv, self.device)
            masks = [
                attention_mask(x, n_cached, c.group_size, self.attn_dtype, self.device)
                if i in launch.fallback
                else None
                for i, (x, n_cached) in enumerate(zip(inputs, cached, strict=True))
            ]
        elif kernel:  # per sequence: slot of every position, new-row mask, cached length
            kernel_args = [
                (kv.read_slots(plan.read), allowed_rows(x), n_cached)
                for x, plan, n_cached in zip(inputs, plans, cached, strict=True)
            ]
        else:
            masks = [
                attention_mask(x, n_cached, c.group_size, self.attn_dtype, self.device)
                for x, n_cached in zip(inputs, cached, strict=True)
            ]
        tokens = torch.cat([x.tokens for x in inputs]).to(self.device)  # [T]
        positions = torch.cat([x.positions for x in inputs]).to(self.device)  # [T]
        write_slots = torch.cat([p.write for p in plans])  # [T]
        cos, sin = self.rotary.tables(positions, self.dtype)  # [T, 1, head_dim] each
        bounds = row_bounds(inputs)
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
            q = qk[:, : c.num_heads]  # [T, heads, head_dim]
            if launch is not None:
                # index values checked once per forward, on a CPU only (on a GPU it would sync)
                check = li == 0 and self.device.type == "cpu"
                o = triton_attention.attend(q, kv, li, launch, hd**-0.5, check).view(t, c.q_size)
                for i in launch.fallback:
                    a, b = bounds[i]
                    o[a:b] = self._attend(q[a:b], kv, li, plans[i], masks[i])
            elif kernel:
                kt_l, v_l = kv.layer_tiled(li)
                parts = [
                    self._attend_kernel(q[a:b], kt_l, v_l, *args)
                    for (a, b), args in zip(bounds, kernel_args, strict=True)
                ]
                o = parts[0] if len(parts) == 1 else torch.cat(parts)
            elif len(inputs) == 1:
                o = self._attend(q, kv, li, plans[0], masks[0])  # [T, q]
            else:
                o = torch.cat(
                    [
                        self._attend(q[a:b], kv, li, plan, mask)
                        for (a, b), plan, mask in zip(bounds, plans, masks, strict=True)
                    ]
                )
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

    def _fold(self, q: torch.Tensor) -> torch.Tensor:
        """[n, heads, head_dim] -> [kv_heads, group * n, head_dim], row g * n + i = row i of head g."""
        c = self.config
        n = q.shape[0]
        if n == 1:
            return q.reshape(c.num_kv_heads, c.group_size, c.head_dim)
        return (
            q.reshape(n, c.num_kv_heads, c.group_size, c.head_dim)
            .permute(1, 2, 0, 3)
            .reshape(c.num_kv_heads, c.group_size * n, c.head_dim)
        )

    def _unfold(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """The inverse of `_fold`, flattened: [kv_heads, group * n, head_dim] -> [n, q_size]."""
        c = self.config
        if n == 1:
            return out.reshape(1, c.q_size)
        out = out.reshape(c.num_kv_heads, c.group_size, n, c.head_dim)
        return out.permute(2, 0, 1, 3).reshape(n, c.q_size)

    def _attend_kernel(
        self,
        q: torch.Tensor,
        kt: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
        cached: int,
    ) -> torch.Tensor:
        """q: [n, heads, head_dim] -> [n, heads * head_dim] through the batch-invariant CPU kernel."""
        n = q.shape[0]
        qg = self._fold(q).contiguous()
        out = cpu_attention.tree_attention(qg, kt, v, slots, allowed, cached, self.config.head_dim**-0.5)
        return self._unfold(out, n)

    def _attend(
        self, q: torch.Tensor, kv: PagedKVCache, layer: int, plan: SeqSlots, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q: [n, heads, head_dim] -> [n, heads * head_dim], over the sequence's cached + new keys.

        Grouped-query attention without repeating K/V: the `group` query heads that share a KV
        head are stacked along the row axis, so SDPA sees [kv_heads, group * n, head_dim] queries
        against [kv_heads, L, head_dim] keys (the mask is repeated per group).
        """
        k, v = kv.layer_kv(layer, plan.read)  # [kv_heads, L, head_dim] each
        dt = self.attn_dtype
        q, k, v = q.to(dt), k.to(dt), v.to(dt)  # no-ops unless the precisions differ
        qg = self._fold(q)
        out = F.scaled_dot_product_attention(qg.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask)
        return self._unfold(out.to(self.dtype), q.shape[0])

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
