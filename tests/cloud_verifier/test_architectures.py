"""The model architectures' registry (shared/model/archs): every loader asks it, refusals name the
supported architectures, and a new architecture is one module plus a registration."""

from __future__ import annotations

import pytest

from shared.model import archs
from shared.model.archs import (
    ARCHITECTURES,
    Architecture,
    by_hf_model_type,
    by_name,
    config_from_hf,
    register,
)
from shared.model.archs.llama import shard_llama_block

HF = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_llama_and_qwen2_are_registered_with_their_differences() -> None:
    assert {"llama", "qwen2"} <= set(ARCHITECTURES)
    assert by_name("llama").gguf_qk_permuted and not by_name("qwen2").gguf_qk_permuted
    assert by_name("qwen2").qkv_bias and not by_name("llama").qkv_bias
    assert by_hf_model_type("mistral") is by_name("llama")
    assert config_from_hf({**HF, "model_type": "qwen2"}).qkv_bias
    assert not config_from_hf({**HF, "model_type": "llama"}).qkv_bias
    assert config_from_hf({**HF, "model_type": "llama", "attention_bias": True}).qkv_bias


def test_refusals_name_what_is_supported() -> None:
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported \(\[.*'qwen2'"):
        config_from_hf({**HF, "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"architecture 'phi3' is not supported \(.*llama, qwen2"):
        by_name("phi3", "GGUF general.architecture")
    with pytest.raises(ValueError, match="already registered"):
        register(Architecture("llama", ("other",), shard_llama_block))
    with pytest.raises(ValueError, match="already belongs"):
        register(Architecture("new", ("qwen2",), shard_llama_block))


def test_a_new_architecture_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archs.registry, "ARCHITECTURES", dict(ARCHITECTURES))
    arch = register(Architecture("granite-like", ("granite_like",), shard_llama_block, qkv_bias=True))
    config = config_from_hf({**HF, "model_type": "granite_like"})
    assert config.architecture == "granite-like" and config.qkv_bias
    assert by_name("granite-like") is arch
