"""The cloud target: a Llama-family decoder with a packed tree-attention forward, its loaders
(GGUF, safetensors) and tokenizer. See docs/architecture.md §3.1, §5 and §6."""

from shared.model.generate import greedy_generate, prefill
from shared.model.inputs import (
    SeqInput,
    check_input,
    decode_step,
    prefill_chunk,
    round_keep,
    tree_round,
)
from shared.model.kv_cache import KVCacheFull, PagedKVCache
from shared.model.llama import LlamaModel
from shared.model.model_config import ModelConfig, RopeScaling, make_tiny_config
from shared.model.target import ALIASES, Target, load_target, smollm2_gguf_path
from shared.model.tokenizer import TargetTokenizer
from shared.model.weights import build_model

__all__ = [
    "ALIASES",
    "KVCacheFull",
    "LlamaModel",
    "ModelConfig",
    "PagedKVCache",
    "RopeScaling",
    "SeqInput",
    "Target",
    "TargetTokenizer",
    "build_model",
    "check_input",
    "decode_step",
    "greedy_generate",
    "load_target",
    "make_tiny_config",
    "prefill",
    "prefill_chunk",
    "round_keep",
    "smollm2_gguf_path",
    "tree_round",
]
