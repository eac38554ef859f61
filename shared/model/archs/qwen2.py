"""`qwen2`: the Llama block with q/k/v biases; llama.cpp keeps its q/k rows as they are (it runs
qwen2 with the half-split RoPE)."""

from __future__ import annotations

from shared.model.archs.llama import shard_llama_block
from shared.model.archs.registry import Architecture, register

QWEN2 = register(
    Architecture(
        name="qwen2",
        hf_model_types=("qwen2",),
        shard_layer=shard_llama_block,  # the biases are split with their rows
        qkv_bias=True,
    )
)
