"""One rank's shard of the target: `shard_model` slices a loaded LlamaModel (Megatron-LM's
layout, see the package doc) into a `ShardedLlamaModel`, and `load_sharded_target` loads a
target and keeps this rank's shard of it.

Sharded weights are loaded on the rank's device in --dtype (the full model is loaded there first,
then sliced and its layers freed one by one: the peak is one full model a GPU), the KV cache of
each rank is on its device, and attention is chosen as at TP=1 (Triton on CUDA). On rank 0 a
forward (and a change of attention or kernels) is first sent to the other ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch import nn

from cloud_verifier.parallel.group import TPGroup
from cloud_verifier.parallel.kv_cache import ShardedKVCache
from cloud_verifier.parallel.protocol import Op, TensorParallelError, encode_inputs
from shared.model.archs import by_name
from shared.model.kv_cache import PagedKVCache
from shared.model.llama import ATTENTION_MODES, GEMM_KINDS, DecoderLayer, LlamaModel, SeqInput, check_input
from shared.model.model_config import ModelConfig, make_tiny_config
from shared.model.quantized import QuantMatrix
from shared.model.target import Target, load_target
from shared.model.weights import build_model, resolve_device, resolve_dtype


def ffn_splits(config: ModelConfig, world: int, block: int = 1) -> list[tuple[int, int]]:
    """Each rank's FFN columns [a, b): equal shares, or with quantized weights (`block`: the
    values in one block of down's type, 32 or 256) shares of whole blocks, the first ranks one
    block more when they do not divide evenly (the 1.5B's 8960 = 35 blocks of 256: 18 + 17)."""
    units, rest = divmod(config.intermediate_size // block, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + (units + (r < rest)) * block)
    return [(bounds[r], bounds[r + 1]) for r in range(world)]


def check_quantized_shardable(config: ModelConfig, world: int, model: str, block: int, o_block: int) -> None:
    """What a split of GGUF blocks needs besides whole GQA groups: each rank's columns of o (its
    heads) and of down (its FFN share) fall on block boundaries, and every rank gets FFN columns."""
    if world < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {world}")
    for what, n in (("num_kv_heads", config.num_kv_heads), ("num_heads", config.num_heads)):
        if n % world:
            raise ValueError(
                f"model {model!r} cannot be split over {world} tensor-parallel ranks: its {what} ({n}) "
                f"is not a multiple of {world}; use --tensor-parallel N with N dividing {config.num_kv_heads}"
            )
    share = config.q_size // world
    if share % o_block:
        raise ValueError(
            f"model {model!r} with --weights quantized cannot be split over {world} ranks: a rank's "
            f"{share} columns of the attention output cut its {o_block}-value blocks; use --weights fp32"
        )
    if config.intermediate_size % block or config.intermediate_size // block < world:
        raise ValueError(
            f"model {model!r} with --weights quantized cannot be split over {world} ranks: its FFN "
            f"({config.intermediate_size} columns) is not {world} or more whole {block}-value blocks; "
            "use --weights fp32"
        )


def check_shardable(config: ModelConfig, world: int, model: str) -> None:
    """Refuse a split that would cut a GQA group, a head or an MLP row block across ranks."""
    if world < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {world}")
    for what, n in (
        ("num_kv_heads", config.num_kv_heads),
        ("num_heads", config.num_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if n % world:
            raise ValueError(
                f"model {model!r} cannot be split over {world} tensor-parallel ranks: its {what} ({n}) "
                f"is not a multiple of {world}; use --tensor-parallel N with N dividing {config.num_kv_heads}"
            )


class ShardedLlamaModel(LlamaModel):
    """One rank's shard. On rank 0 a forward (and a change of attention or kernels) is first sent
    to the other ranks; its `config` is the shard's (heads, KV heads, intermediate size / N)."""

    def __init__(
        self,
        config: ModelConfig,
        full: ModelConfig,
        group: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        gemm_kind: str,
    ) -> None:
        super().__init__(config, dtype, device, gemm_kind)
        self.full_config = full
        self.group = group
        self.all_reduce = group.all_reduce
        self.gather_logits = group.gather_logits(full.vocab_size)

    def set_attention(self, mode: str) -> None:
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
        g = self.__dict__.get("group")
        if isinstance(g, TPGroup) and g.rank == 0:
            with g.lock:
                g.send(Op.SET_ATTENTION, args=(ATTENTION_MODES.index(mode),))
                super().set_attention(mode)
        else:
            super().set_attention(mode)

    def set_gemm(self, kind: str) -> None:
        if kind not in GEMM_KINDS:
            raise ValueError(f"gemm must be one of {GEMM_KINDS}, got {kind!r}")
        self._check_weights("set_gemm")
        g = self.group
        if g.rank == 0:
            with g.lock:
                g.send(Op.SET_GEMM, args=(GEMM_KINDS.index(kind),))
                super().set_gemm(kind)
        else:
            super().set_gemm(kind)

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        if self.group.rank != 0:
            return super().new_kv_cache(num_blocks, block_size)
        local = super().new_kv_cache(num_blocks, block_size)  # its shape and options, then shared
        g = self.group
        with g.lock:
            cid = g.new_cache_id()
            g.send(Op.NEW_CACHE, cid, (num_blocks, block_size))
        return ShardedKVCache(g, cid, local)

    @torch.inference_mode()
    def forward_packed(self, inputs: list[SeqInput], kv: PagedKVCache) -> list[torch.Tensor]:
        g = self.group
        if g.rank != 0:
            return super().forward_packed(inputs, kv)
        if not isinstance(kv, ShardedKVCache) or kv.group is not g:
            raise TypeError("a tensor-parallel model needs a KV cache made by its new_kv_cache")
        if not inputs:
            return []
        for x in inputs:
            check_input(x, self.config.vocab_size)
        ints, data = encode_inputs(inputs)
        with g.lock:
            g.check()
            g.send(Op.FORWARD, kv.cache_id, ints=ints, data=data)
            g.forwarding = True
        try:
            # (the engine's forward thread: kernels and NCCL on this rank's GPU, not the thread's default)
            with torch.cuda.device(g.device) if g.device.type == "cuda" else contextlib.nullcontext():
                return super().forward_packed(inputs, kv)
        finally:
            _end_forward(g)


def _end_forward(g: TPGroup) -> None:
    """After a forward: apply and send what the event loop did meanwhile, in its order."""
    with g.lock:
        g.forwarding = False
        deferred, g.deferred = g.deferred, []
        for finish, op, cache, args in deferred:
            finish()
            if g.error is None:
                try:
                    g.send(op, cache, args)
                except TensorParallelError:
                    pass
        g.idle.notify_all()


def shard_model(full: LlamaModel, group: TPGroup, name: str) -> ShardedLlamaModel:
    """Rank `group.rank`'s shard of `full`; each of full's layers is freed right after slicing
    (the embedding table is shared, not copied). A model on GGUF blocks is split as blocks
    (`shard_quantized`)."""
    if full.weights == "quantized":
        return shard_quantized(full, group, name)
    c, n, r = full.config, group.world, group.rank
    check_shardable(c, n, name)
    local_cfg = replace(
        c,
        num_heads=c.num_heads // n,
        num_kv_heads=c.num_kv_heads // n,
        intermediate_size=c.intermediate_size // n,
        tie_embeddings=False,
    )
    model = ShardedLlamaModel(local_cfg, c, group, full.dtype, full.device, full.gemm_kind)
    shard_layer = by_name(c.architecture).shard_layer  # the architecture's rule (shared/model/archs)
    for src, dst in zip(full.layers, model.layers, strict=True):
        assert isinstance(src, DecoderLayer) and isinstance(dst, DecoderLayer)
        shard_layer(src, dst, r, n, c)
    model.embed = full.embed
    model.norm = full.norm
    shard = -(-c.vocab_size // n)
    head = full.lm_head[r * shard : min(c.vocab_size, (r + 1) * shard)]
    # tied: a view of the shared embedding table (packing copies it anyway); untied: its own copy
    model.lm_head = nn.Parameter(
        head if full.lm_head is full.embed else head.contiguous(), requires_grad=False
    )
    if full.lm_head is not full.embed:
        full.lm_head.data = full.lm_head.data.new_empty(0)
    LlamaModel.set_attention(model, full.attention_mode)  # (every rank does it: nothing to send)
    return model


def quantized_blocks(full: LlamaModel) -> tuple[int, int]:
    """The block sizes a split of `full`'s GGUF blocks must respect: (down's, o's), over all layers."""
    layers = full.prepare().layers
    return (
        max(ws[3].column_block for ws in layers if isinstance(ws[3], QuantMatrix)),
        max(ws[1].column_block for ws in layers if isinstance(ws[1], QuantMatrix)),
    )


def shard_quantized(full: LlamaModel, group: TPGroup, name: str) -> ShardedLlamaModel:
    """Rank `group.rank`'s shard of a model on GGUF blocks (`--weights quantized`): the same layout
    as the float split, cut between blocks. Rows (q, k, v heads; gate and up; the vocabulary) are
    views of the file's blocks; columns (o's and down's share) are copied, 1/N of those matrices.
    A rank's FFN share is whole blocks of down's type (`ffn_splits`: uneven where they do not
    divide), so each rank's local config may differ in intermediate_size only."""
    c, n, r = full.config, group.world, group.rank
    block, o_block = quantized_blocks(full)
    check_quantized_shardable(c, n, name, block, o_block)
    a, b = ffn_splits(c, n, block)[r]
    local_cfg = replace(
        c, num_heads=c.num_heads // n, num_kv_heads=c.num_kv_heads // n, intermediate_size=b - a
    )
    local_cfg = replace(local_cfg, tie_embeddings=False)
    model = ShardedLlamaModel(local_cfg, c, group, full.dtype, full.device, full.gemm_kind)
    q, kvs, i = c.q_size // n, c.kv_size // n, c.intermediate_size
    heads = [(r * q, (r + 1) * q), (c.q_size + r * kvs, c.q_size + (r + 1) * kvs)]
    heads.append((c.q_size + c.kv_size + r * kvs, c.q_size + c.kv_size + (r + 1) * kvs))
    prep = full.prepare()
    layers = []
    for src, dst, ws in zip(full.layers, model.layers, prep.layers, strict=True):
        assert isinstance(src, DecoderLayer) and isinstance(dst, DecoderLayer)
        w_qkv, w_o, w_gu, w_down = ws
        assert isinstance(w_qkv, QuantMatrix) and isinstance(w_o, QuantMatrix)
        assert isinstance(w_gu, QuantMatrix) and isinstance(w_down, QuantMatrix)
        dst.attn_norm, dst.mlp_norm = src.attn_norm, src.mlp_norm
        if src.qkv_bias is not None:
            dst.qkv_bias = nn.Parameter(torch.cat([src.qkv_bias[x:y] for x, y in heads]), requires_grad=False)
        layers.append(
            (
                w_qkv.take_rows(heads),
                w_o.take_columns(r * q, (r + 1) * q),
                w_gu.take_rows([(a, b), (i + a, i + b)]),
                w_down.take_columns(a, b),
            )
        )
    model.embed = full.embed
    model.norm = full.norm
    shard = -(-c.vocab_size // n)
    rows = (r * shard, min(c.vocab_size, (r + 1) * shard))
    head = prep.lm_head
    assert isinstance(head, QuantMatrix), "a quantized model's head is blocks"
    model.use_quantized(layers, head.take_rows([rows]), full._quant_embed, head_rows=rows[1] - rows[0])
    full._prepared = None  # the full model's matrices: only this rank's share stays referenced
    LlamaModel.set_attention(model, full.attention_mode)
    return model


def load_sharded_target(
    group: TPGroup,
    name: str,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
    attention: str = "model",
    weights: str = "fp32",
) -> Target:
    """`load_target` on the group's device (`device` must resolve to its type), then this rank's
    shard of it (the Target keeps the full ModelConfig). `weights`: "fp32" or "quantized" (every
    rank must load the same: resolve "auto" once, before the ranks start)."""
    if resolve_device(device).type != group.device.type:
        raise ValueError(
            f"--device {device} but the tensor-parallel group runs on {group.device.type} "
            f"({group.backend}); give the same --device to every rank"
        )
    full = load_target(name, dtype, str(group.device), progress and group.rank == 0, attention, weights)
    model = shard_model(full.model, group, name)
    return replace(full, model=model)


def load_worker_model(
    name: str, dtype: str, device: str, attention: str, weights: str = "fp32"
) -> LlamaModel:
    """A worker's model: as `load_target` loads it, without the tokenizer where that is avoidable
    (`tiny`: the seeded random weights of target.py, in 0.4 s instead of 10)."""
    if name != "tiny" or weights != "fp32":
        return load_target(name, dtype, device, False, attention, weights).model
    dev = resolve_device(device)
    model = build_model(make_tiny_config(), 0, resolve_dtype(dtype, dev), dev)
    model.set_attention(attention)
    return model
