"""The target's architecture: one frozen dataclass, read from GGUF metadata
(shared/model/gguf_loader.py) or a config.json (shared/model/archs/hf_config.py).

Covers the Llama family this runtime runs: Llama 2/3 (with Llama-3 `rope_scaling`), SmolLM2,
Mistral-style dense models and Qwen2 (q/k/v biases). Anything else is refused by the loaders
with the field that was not understood, rather than run with a silently wrong layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

SMOLLM2_VOCAB = 49152


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling.

    kind "llama3": Llama 3.1's smooth low/high-frequency rescaling; kind "linear": positions
    divided by `factor`. `freq_factors` (GGUF `rope_freqs.weight`, llama.cpp's precomputed form of
    the llama3 rule) divides the base inverse frequencies directly when given.
    """

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] | None = None


_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position",
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_position: int = 8192
    architecture: str = "llama"

    def __post_init__(self) -> None:
        for name in _SIZES:  # a zero here divides by zero or builds an empty model further on
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


def make_tiny_config(vocab_size: int = SMOLLM2_VOCAB, seed: int = 0, **overrides: Any) -> ModelConfig:
    """A small Llama (8 heads, 2 KV heads) that runs in milliseconds on a CPU.

    `seed` is not part of the architecture; it is accepted so call sites read
    `make_tiny_config(vocab, seed)` next to `build_model(config, seed, ...)`, and it varies nothing.
    """
    del seed
    base = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_embeddings=True,
        max_position=8192,
    )
    return replace(base, **overrides)
