"""`llama` (and config.json's `mistral`): the block every architecture here shares, and its
tensor-parallel rule (Megatron-style: attention heads and FFN columns split over ranks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shared.model.archs.registry import Architecture, register

if TYPE_CHECKING:
    from shared.model.llama import DecoderLayer
    from shared.model.model_config import ModelConfig


def shard_llama_block(src: DecoderLayer, dst: DecoderLayer, rank: int, world: int, c: ModelConfig) -> None:
    """Rank `rank`'s slice of one block: its q, k and v heads (rows of the fused q|k|v and its
    bias), the matching columns of o, its FFN columns of gate|up and rows of down's input; the
    norms are shared. The source's projections are freed after slicing."""
    q, kvs, inter = c.q_size // world, c.kv_size // world, c.intermediate_size // world
    r = rank
    rows = [
        slice(r * q, (r + 1) * q),
        slice(c.q_size + r * kvs, c.q_size + (r + 1) * kvs),
        slice(c.q_size + c.kv_size + r * kvs, c.q_size + c.kv_size + (r + 1) * kvs),
    ]
    ffn = [
        slice(r * inter, (r + 1) * inter),
        slice(c.intermediate_size + r * inter, c.intermediate_size + (r + 1) * inter),
    ]

    def param(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t, requires_grad=False)

    dst.attn_norm = src.attn_norm
    dst.mlp_norm = src.mlp_norm
    dst.qkv = param(torch.cat([src.qkv[s] for s in rows]))
    if src.qkv_bias is not None:
        dst.qkv_bias = param(torch.cat([src.qkv_bias[s] for s in rows]))
    dst.o = param(src.o[:, r * q : (r + 1) * q].contiguous())
    dst.gate_up = param(torch.cat([src.gate_up[s] for s in ffn]))
    dst.down = param(src.down[:, r * inter : (r + 1) * inter].contiguous())
    for p in (src.qkv, src.o, src.gate_up, src.down):
        p.data = p.data.new_empty(0)


LLAMA = register(
    Architecture(
        name="llama",
        hf_model_types=("llama", "mistral"),
        shard_layer=shard_llama_block,
        gguf_qk_permuted=True,  # llama.cpp runs llama with interleaved RoPE pairs
    )
)
