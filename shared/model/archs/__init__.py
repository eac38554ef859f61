"""The registered model architectures (registry.py); importing this package registers them all.
`config_from_hf` (hf_config.py) reads a Hugging Face config.json into a `ModelConfig` by them."""

from shared.model.archs import llama, qwen2
from shared.model.archs.hf_config import config_from_hf, rope_scaling_from_hf
from shared.model.archs.registry import ARCHITECTURES, Architecture, by_hf_model_type, by_name, register

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "by_hf_model_type",
    "by_name",
    "config_from_hf",
    "llama",
    "qwen2",
    "register",
    "rope_scaling_from_hf",
]
