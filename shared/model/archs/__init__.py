"""The registered model architectures (registry.py); importing this package registers them all."""

from shared.model.archs import llama, qwen2
from shared.model.archs.registry import ARCHITECTURES, Architecture, by_hf_model_type, by_name, register

__all__ = ["ARCHITECTURES", "Architecture", "by_hf_model_type", "by_name", "llama", "qwen2", "register"]
