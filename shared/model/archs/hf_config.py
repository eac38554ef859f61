"""Hugging Face config.json -> `ModelConfig`: config.json's `model_type` names the registered
architecture (registry.py), which says what the file leaves implicit (q/k/v biases); the sizes,
RoPE and norm settings are read from the file. A setting this runtime does not run (an activation
other than SiLU, an unknown RoPE scaling) is refused with its name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.archs.registry import by_hf_model_type
from shared.model.model_config import ModelConfig, RopeScaling


def rope_scaling_from_hf(raw: Mapping[str, Any] | None) -> RopeScaling | None:
    """Parse config.json's `rope_scaling` (or transformers 5's `rope_parameters`)."""
    if not raw:
        return None
    kind = str(raw.get("rope_type", raw.get("type", "default")))
    if kind == "default":
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position=int(raw.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, linear)")


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dictionary."""
    model_type = str(cfg.get("model_type", "llama"))
    arch = by_hf_model_type(model_type)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(cfg.get("rope_parameters"), Mapping):
        theta = cfg["rope_parameters"].get("rope_theta")
    qkv_bias = arch.qkv_bias or bool(cfg.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=rope_scaling_from_hf(rope_params),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        max_position=int(cfg.get("max_position_embeddings", 8192)),
        architecture=arch.name,
    )
