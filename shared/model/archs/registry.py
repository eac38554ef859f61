"""The model architectures the target and the torch drafter run, one registration each.

An `Architecture` says everything that differs between the Llama-family checkpoints the loaders
read: its names (GGUF `general.architecture`, config.json `model_type`), how its GGUF tensors
are named and stored (llama.cpp permutes q/k rows for `llama`), whether its q/k/v projections
always carry biases, and how tensor parallelism splits one of its blocks over ranks. The
computation itself is `LlamaModel`'s (shared/model/llama.py): every registered architecture is
that block with these differences.

How to add one: a module in this package that builds an `Architecture` and calls `register`,
imported by the package's `__init__`; docs/architecture.md §10.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.model.llama import DecoderLayer
    from shared.model.model_config import ModelConfig

# (source block, its shard on rank r, r, ranks, the full model's config): fill the shard's parameters
ShardLayer = Callable[["DecoderLayer", "DecoderLayer", int, int, "ModelConfig"], None]

# llama.cpp tensor names -> Hugging Face names
LLAMA_CPP_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LLAMA_CPP_BLOCK = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture and GGUF general.architecture
    hf_model_types: tuple[str, ...]  # config.json model_type values read as this architecture
    shard_layer: ShardLayer  # tensor parallelism: one block's slice for one rank
    gguf_qk_permuted: bool = False  # llama.cpp's converter interleaved q/k rows: undo on load
    qkv_bias: bool = False  # q/k/v biases even when config.json says nothing (attention_bias)
    gguf_top: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_CPP_TOP))
    gguf_block: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_CPP_BLOCK))


ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    if arch.name in ARCHITECTURES:
        raise ValueError(f"architecture {arch.name!r} is already registered")
    taken = {t for a in ARCHITECTURES.values() for t in a.hf_model_types} & set(arch.hf_model_types)
    if taken:
        raise ValueError(f"config.json model_type {sorted(taken)} already belongs to another architecture")
    ARCHITECTURES[arch.name] = arch
    return arch


def by_name(name: str, what: str = "architecture") -> Architecture:
    """The registered architecture `name`; ValueError naming the supported ones."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"{what} {name!r} is not supported ({', '.join(sorted(ARCHITECTURES))})") from None


def by_hf_model_type(model_type: str) -> Architecture:
    for arch in ARCHITECTURES.values():
        if model_type in arch.hf_model_types:
            return arch
    known = sorted(t for a in ARCHITECTURES.values() for t in a.hf_model_types)
    raise ValueError(f"config.json model_type {model_type!r} is not supported ({known})")
