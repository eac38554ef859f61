"""Llama-family decoder with a packed tree-attention forward (SpecInfer's tree-based parallel decoding).

One `forward_packed` call serves every ready sequence of an engine step: tree rounds (row 0 + the
tree's nodes, attention limited by the topology-aware mask), chunked prefills (causal) and
single-token decode steps. The rows of all sequences are concatenated so each weight matrix is
read once per step for all of them (on a memory-bound device that is the whole point: verifying
N rows costs about one decode step); only attention runs per sequence, over that sequence's paged
KV cache. Projections are fused (q|k|v and gate|up) to halve the number of matmul launches, and
the LM head runs only on the rows whose logits are asked for.

The decoder's two parts are at the end of this module: rotary position embeddings (`Rotary`) and
the projections' matrix products (`Gemm`).

Rotary position embeddings (RoPE) are in the rotate-half layout of Hugging Face checkpoints.
Positions are absolute (docs/architecture.md §3.1: a tree node sits at base + len(cond) + depth - 1),
so the cos/sin rows are computed per packed row from its own position, once per forward, and shared
by every layer.

Matrix products of the projections: plain torch, or oneDNN with pre-packed weights.

On CPU, `F.linear` goes through MKL's sgemm, which re-packs the weight matrix on every call; for the
skinny products of decoding (1 to ~64 rows) that repacking costs as much as the product itself, and
on AMD CPUs MKL also takes a slow generic path. Packing each weight once into oneDNN's blocked
layout (the same kernels torch.compile's CPU freezing uses) measured here on a Zen 4 core pair: a
decode step's projections 33 -> 19 ms, a 16-row tree 47 -> 24 ms, the 49,152-row LM head 8.9 ->
3.7 ms. The packed copy lives beside the original weights (which the embedding lookup, tests and
checkpoints keep using), so memory for the projections doubles on CPU.

`Gemm` hides the choice: `pack(weight)` once, then `linear(x, packed, bias)` per call.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.model import attention
from shared.model.attention import ATTENTION_MODES
from shared.model.inputs import SeqInput, check_input, row_bounds
from shared.model.kv_cache import TILE, PagedKVCache
from shared.model.model_config import ModelConfig, RopeScaling
from shared.model.quantized import QuantMatrix
from treespec_kernels import cpu_attention
from treespec_kernels import quant_matmul as qm

# SeqInput and check_input are part of this module's interface (the sharded model imports them here)


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


# a projection as the forward uses it: the Gemm's prepared float weight, or GGUF blocks
class RowChunks:
    """A projection [out, in] prepared in chunks of output rows (`rows` each, the last shorter): its
    product is the concatenation of the chunks' products. oneDNN heads are prepared this way, so a
    head held in memory and one streamed a chunk at a time from disk (offload_head.StreamedRows) run the
    very same products and give the same bits; the packing's temporary copy is a chunk's, not the
    head's."""

    def __init__(self, parts: list[torch.Tensor], rows: int, out_features: int, in_features: int) -> None:
        self.parts, self.rows = parts, rows
        self.out_features, self.in_features = out_features, in_features

    def chunks(self) -> Iterator[torch.Tensor]:
        """Each chunk's prepared weight, in order."""
        yield from self.parts

    def linear(self, gemm: Gemm, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] -> [rows, out]."""
        return torch.cat([gemm.linear(x, part) for part in self.chunks()], dim=1)

    @property
    def nbytes(self) -> int:
        """Bytes of the chunks held in memory."""
        return sum(p.numel() * p.element_size() for p in self.parts)


Weight = torch.Tensor | QuantMatrix | RowChunks


@dataclass(frozen=True)
class _Prepared:
    """Per-layer projection weights in the Gemm's prepared form (see `Gemm`), or as GGUF blocks
    (`LlamaModel.use_quantized`)."""

    gemm: Gemm
    # qkv, o, gate_up, down per layer; a StreamedLayers (offload.py) yields them as it reads them
    layers: Iterable[tuple[Weight, Weight, Weight, Weight]]
    lm_head: Weight


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
        self.weights = "fp32"  # or "quantized": the projections are GGUF blocks (use_quantized)
        self._quant_embed: QuantMatrix | None = None  # the token table as blocks (quantized weights)
        self.embed_rows: Any = None  # the token table left on disk (offload.TableRows: .rows(tokens))
        self.attn_dtype = dtype
        self._mode = "model"  # one of ATTENTION_MODES
        self._backend: attention.AttentionBackend | None = None  # chosen from the mode on first use
        # tensor parallelism (cloud_verifier.parallel) sums a layer's partial o / down output over the ranks
        # in place, and gathers the vocab-parallel head's logit shards; None on one process
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        # streamed layers (shared/model/offload.py: offload.attach), or None when all are resident
        self.offload: Any = None

    def set_attention(self, mode: str) -> None:
        """One of ATTENTION_MODES (see the class doc). Caches made before the switch still
        work (converted per layer, or through SDPA when they lack the kernel's tiled keys), at a cost."""
        attention.check_mode(self.attention_spec, mode)
        self.attn_dtype = torch.float64 if mode == "float64" else self.dtype
        self._mode = mode
        self._backend = None

    @property
    def attention_mode(self) -> str:
        if self._mode == "float64" and self.dtype == torch.float64:
            return "model"
        return self._mode

    @property
    def attention_spec(self) -> attention.AttentionSpec:
        """What the attention backends are told of this model: its heads, dtypes and device."""
        c = self.config
        return attention.AttentionSpec(
            c.num_heads, c.num_kv_heads, c.head_dim, self.dtype, self.attn_dtype, self.device
        )

    @property
    def attention_backend(self) -> attention.AttentionBackend:
        """The backend the mode chose (attention.choose), chosen once."""
        if self._backend is None:
            self._backend = attention.choose(self.attention_spec, self._mode)
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

    def _fused_rope(self, kv: PagedKVCache) -> bool:
        """Whether a forward's rotary embedding and K/V store run as the CPU kernel's one pass a
        layer (float32 on a CPU, a pool with tiled keys, the kernel built, not turned off by
        TREESPEC_FUSED_ROPE=0): the same bits as Rotary.apply then PagedKVCache.write."""
        return (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and kv.dtype == torch.float32
            and kv.kt is not None
            and os.environ.get("TREESPEC_FUSED_ROPE", "1") != "0"
            and cpu_attention.load() is not None
        )

    def set_gemm(self, kind: str) -> None:
        """Choose the projection kernels ("auto", "onednn", "torch"); re-prepares lazily."""
        self._check_weights("set_gemm")
        choose_gemm(kind, self.device, self.dtype)
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

            g = Gemm(choose_gemm(self.gemm_kind, self.device, self.dtype))
            release = release and g.kind == "onednn"
            layers = []
            for layer in tqdm(self.layers, desc="packing weights", unit="layer", disable=not progress):
                assert isinstance(layer, DecoderLayer)
                packed = (g.pack(layer.qkv), g.pack(layer.o), g.pack(layer.gate_up), g.pack(layer.down))
                layers.append(packed)
                if release:
                    for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
                        p.data = p.data.new_empty(0)
            head = g.pack_rows(self.lm_head)
            if release and self.lm_head is not self.embed:
                self.lm_head.data = self.lm_head.data.new_empty(0)
            self._prepared = _Prepared(g, layers, head)
            self.released = self.released or release
        return self._prepared

    def use_quantized(
        self,
        layers: list[tuple[QuantMatrix, QuantMatrix, QuantMatrix, QuantMatrix]],
        lm_head: Weight,
        embed: QuantMatrix | None = None,
        head_rows: int | None = None,
    ) -> None:
        """Run the projections (per layer q|k|v, o, gate|up, down) and the head from GGUF blocks
        (shared/model/quantized.py), and the token lookup too when `embed` is given. The float
        projections (and the float token table, with `embed`) are freed: like
        `prepare(release=True)`, the weights can no longer be read or re-packed. `head_rows`: the
        head's rows when it is not the whole vocabulary (a tensor-parallel rank's share)."""
        c = self.config
        want = (
            (c.q_size + 2 * c.kv_size, c.hidden_size),
            (c.hidden_size, c.q_size),
            (2 * c.intermediate_size, c.hidden_size),
            (c.hidden_size, c.intermediate_size),
        )
        if len(layers) != c.num_layers:
            raise ValueError(f"{len(layers)} layers of quantized weights for a model of {c.num_layers}")
        shapes = [(m.out_features, m.in_features) for ws in layers for m in ws]
        for i, shape in enumerate(shapes):
            if shape != want[i % 4]:
                raise ValueError(f"layer {i // 4}, projection {i % 4}: shape {shape}, expected {want[i % 4]}")
        tables = [(m, n) for m, n in ((lm_head, head_rows), (embed, None)) if isinstance(m, QuantMatrix)]
        for m, n in tables:
            want_table = (c.vocab_size if n is None else n, c.hidden_size)
            if (m.out_features, m.in_features) != want_table:
                raise ValueError(
                    f"a token table of shape {(m.out_features, m.in_features)}, expected {want_table}"
                )
        if qm.packing():
            layers = [(a.packed(), b.packed(), g.packed(), d.packed()) for a, b, g, d in layers]
            if isinstance(lm_head, QuantMatrix):
                lm_head = lm_head.packed()
        self._prepared = _Prepared(Gemm("torch"), layers, lm_head)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
                p.data = p.data.new_empty(0)
        if self.lm_head is not self.embed and isinstance(lm_head, QuantMatrix):
            self.lm_head.data = self.lm_head.data.new_empty(0)
        if embed is not None:
            self._quant_embed = embed
            self.embed.data = self.embed.data.new_empty(0)
        self.released = True
        self.weights = "quantized"

    def weight_bytes(self) -> int:
        """Bytes of the weights as this model runs them: the float parameters it holds (none of the
        released projections) plus, with quantized weights, the blocks; with float weights the
        configuration's parameter count in the dtype (the packed copies are not parameters). A
        quantized matrix the kernel repacked counts its packed copy, which every forward reads, not
        its blocks (paged out after packing; read again only where a lookup needs them)."""
        if self.offload is not None:  # the resident layers and the stream buffers, not the file
            own = sum(p.numel() * p.element_size() for p in self.parameters())
            head = self.prepare().lm_head
            if isinstance(head, RowChunks):  # the chunks held, or a streamed head's buffers
                own += head.nbytes + getattr(head, "buffer_bytes", 0)
            elif isinstance(head, torch.Tensor) and all(head is not p for p in self.parameters()):
                own += head.numel() * head.element_size()  # the packed head is a copy
            tables = [m for m in (head, self._quant_embed) if isinstance(m, QuantMatrix)]
            # a tied head and token table are two matrices over the same blocks: count them once
            blocks = {part.blocks.data_ptr(): int(part.blocks.numel()) for m in tables for part in m.parts}
            own += sum(blocks.values())
            stream = self.offload
            return int(own + stream.resident_bytes + sum(int(b.numel()) for b in stream.buffers))
        if self.weights != "quantized":
            return self.config.num_parameters() * torch.finfo(self.dtype).bits // 8
        own = sum(p.numel() * p.element_size() for p in self.parameters())
        prep = self.prepare()
        mats = {id(m): m for ws in prep.layers for m in ws if isinstance(m, QuantMatrix)}
        for m in (prep.lm_head, self._quant_embed):
            if isinstance(m, QuantMatrix):
                mats[id(m)] = m
        return own + sum(m.resident_nbytes for m in mats.values())

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> [T, hidden]: the table's rows (dequantized exactly when it is blocks)."""
        if self._quant_embed is not None:
            return self._quant_embed.rows(tokens)
        if self.embed_rows is not None:
            rows: torch.Tensor = self.embed_rows.rows(tokens)
            return rows
        return F.embedding(tokens, self.embed)

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
        attend = attention.for_pool(self.attention_backend, kv).prepare(self.attention_spec, rows, kv)
        tokens = torch.cat([x.tokens for x in inputs]).to(self.device)  # [T]
        positions = torch.cat([x.positions for x in inputs]).to(self.device)  # [T]
        write_slots = torch.cat([p.write for p in plans])  # [T]
        cos, sin = self.rotary.tables(positions, self.dtype)  # [T, 1, head_dim] each
        prep = self.prepare()
        lin = prep.gemm.linear
        h = self.embed_tokens(tokens)  # [T, hidden]
        t, hd, inter = h.shape[0], c.head_dim, c.intermediate_size
        qk_heads = c.num_heads + c.num_kv_heads
        norm = self._norm()
        fused = self._fused_rope(kv)
        for li, (layer, (w_qkv, w_o, w_gu, w_down)) in enumerate(zip(self.layers, prep.layers, strict=True)):
            assert isinstance(layer, DecoderLayer)
            qkv = lin(norm(h, layer.attn_norm), w_qkv, layer.qkv_bias)  # [T, q + 2 kv]
            if fused:
                q = cpu_attention.rope_store(
                    qkv, cos.view(t, hd), sin.view(t, hd), write_slots, kv.layer_pool(li), c.num_heads
                )
            else:
                qk = self.rotary.apply(qkv[:, : qk_heads * hd].view(t, qk_heads, hd), cos, sin)
                kv.write(
                    li, write_slots, qk[:, c.num_heads :], qkv[:, qk_heads * hd :].view(t, c.num_kv_heads, hd)
                )
                q = qk[:, : c.num_heads]
            o = attend(q, li)  # [T, heads * head_dim]
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


# ---------------------------------------------------------------------------------------------------
# Rotary position embeddings (RoPE)


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with the model's rope scaling applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = config.rope_scaling
    if sc is None or sc.kind == "linear":
        return inv
    if sc.freq_factors is not None:
        factors = torch.tensor(sc.freq_factors, dtype=torch.float32)
        if factors.numel() != inv.numel():
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv.numel()}")
        return inv / factors
    if sc.kind == "llama3":
        return _llama3_scaled(inv, sc)
    raise ValueError(f"rope scaling {sc.kind!r} is not supported")


def _llama3_scaled(inv: torch.Tensor, sc: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rule: keep high frequencies, divide low ones by `factor`, blend in between.

    Wavelengths shorter than original_max_position / high_freq_factor are untouched; those longer
    than original_max_position / low_freq_factor are stretched by `factor`; the band between is a
    linear blend in (original_max_position / wavelength).
    """
    wavelength = 2 * math.pi / inv
    low_wl = sc.original_max_position / sc.low_freq_factor
    high_wl = sc.original_max_position / sc.high_freq_factor
    stretched = torch.where(wavelength > low_wl, inv / sc.factor, inv)
    blend = (sc.original_max_position / wavelength - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (1 - blend) * stretched / sc.factor + blend * stretched
    middle = (wavelength >= high_wl) & (wavelength <= low_wl)
    return torch.where(middle, smoothed, stretched)


class Rotary:
    """Computes cos and sign-folded sin rows for absolute positions.

    The rotate-half rotation is x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]. Folding
    the minus sign into sin ([-sin, sin]) turns it into x*cos + swap(x)*sin_signed: one cat and one
    fused multiply-add per call instead of a negation, a cat and two products.
    """

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(config).to(device)  # [head_dim / 2] float32
        sc = config.rope_scaling
        self.position_scale = 1.0 / sc.factor if sc is not None and sc.kind == "linear" else 1.0
        self.half = config.head_dim // 2

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin_signed), each [T, 1, head_dim] in `dtype`."""
        pos = positions.to(torch.float32)
        if self.position_scale != 1.0:
            pos = pos * self.position_scale
        freqs = torch.outer(pos, self.inv_freq)  # [T, head_dim / 2]
        cos = freqs.cos()
        sin = freqs.sin()
        cos_full = torch.cat((cos, cos), dim=-1)
        sin_signed = torch.cat((-sin, sin), dim=-1)
        return cos_full.to(dtype).unsqueeze(1), sin_signed.to(dtype).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos, sin_signed: [T, 1, head_dim] -> rotated [T, heads, head_dim]."""
        swapped = torch.cat((x[..., self.half :], x[..., : self.half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin_signed)


# ---------------------------------------------------------------------------------------------------
# The projections' matrix products
# oneDNN picks its blocked layout for an expected row count; 16 serves 1..300 rows within a few %
PACK_ROWS_HINT = 16
GEMM_MIN_ROWS = 4  # products of fewer rows are padded (see Gemm.linear)
HEAD_CHUNK_ROWS = 8192  # output rows per chunk of a oneDNN head (RowChunks): 48 MB of the 1.5B's fp32 head
GEMM_KINDS = ("auto", "onednn", "torch")


def onednn_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def choose_gemm(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve "auto": oneDNN for float32 on CPU when torch has it, plain torch otherwise."""
    if kind not in GEMM_KINDS:
        raise ValueError(f"gemm must be one of {GEMM_KINDS}, got {kind!r}")
    if kind == "auto":
        return "onednn" if device.type == "cpu" and dtype == torch.float32 and onednn_available() else "torch"
    if kind == "onednn" and (device.type != "cpu" or not onednn_available()):
        raise ValueError("gemm 'onednn' needs a CPU device and a torch built with oneDNN")
    return kind


class Gemm:
    """y = x @ weight.T + bias with the weight prepared once."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight: [out, in] -> an opaque prepared weight for `linear`."""
        if self.kind == "onednn":
            ops = torch.ops.mkldnn
            prepared: torch.Tensor = ops._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
            return prepared
        return weight

    def pack_rows(self, weight: torch.Tensor) -> torch.Tensor | RowChunks:
        """A head [vocab, hidden] prepared as `pack` does; for oneDNN in chunks of HEAD_CHUNK_ROWS
        rows (RowChunks) when it has more rows than one chunk."""
        rows = HEAD_CHUNK_ROWS
        if self.kind != "onednn" or weight.shape[0] <= rows:
            return self.pack(weight)
        parts = [self.pack(weight[a : a + rows]) for a in range(0, weight.shape[0], rows)]
        return RowChunks(parts, rows, weight.shape[0], weight.shape[1])

    def linear(self, x: torch.Tensor, packed: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [rows, in] -> [rows, out]."""
        if isinstance(packed, RowChunks):
            assert bias is None
            return packed.linear(self, x)
        if isinstance(packed, QuantMatrix):
            return packed.linear(x, bias)
        if self.kind == "onednn":
            rows = x.shape[0]
            if rows < GEMM_MIN_ROWS:
                # Two reasons to pad: oneDNN's 1-row kernel sums in another order than its
                # many-row one (for inputs over ~1024 features), and its 1- and 2-row kernels are
                # slower than the 4-row one (~40 vs ~28 ms for a SmolLM2 step on one core). With
                # >= 2 rows every row is computed the same way whatever the row count, so a decode
                # step stays bit-identical to the same row inside a tree.
                padded = x.new_zeros(GEMM_MIN_ROWS, x.shape[1])
                padded[:rows] = x
                y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")
                return y[:rows]
            linear = torch.ops.mkldnn._linear_pointwise
            out: torch.Tensor = linear(x.contiguous(), packed, bias, "none", [], "")
            return out
        return F.linear(x, packed, bias)


__all__ = ["ATTENTION_MODES", "DecoderLayer", "LlamaModel", "SeqInput", "check_input", "rms_norm"]
