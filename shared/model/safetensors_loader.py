"""Loading a Hugging Face model directory: config.json + *.safetensors + tokenizer files.

This is how real deployments ship a target (docs/architecture.md §5). Tensors are read one at a time
(memory-mapped by safetensors) and copied straight into the model's fused parameters, so peak
memory stays near one copy of the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from shared.model.archs import config_from_hf
from shared.model.llama import LlamaModel
from shared.model.model_config import ModelConfig
from shared.model.tokenizer import TargetTokenizer
from shared.model.weights import WeightAssigner


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def config_from_dir(directory: Path) -> ModelConfig:
    cfg = _read_json(directory / "config.json")
    if not cfg:
        raise FileNotFoundError(f"{directory} has no config.json")
    return config_from_hf(cfg)


def load_safetensors_weights(directory: Path, model: LlamaModel, progress: bool = True) -> None:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors files")
    assigner = WeightAssigner(model)
    with tqdm(desc="loading safetensors", unit="tensor", disable=not progress) as bar:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if assigner.target(name) is not None:
                        assigner.assign(name, st.get_tensor(name))
                    bar.update()
    assigner.finish()


def _token_id(tok_json: dict[str, Any], text: Any) -> int | None:
    if isinstance(text, dict):
        text = text.get("content")
    if not isinstance(text, str):
        return None
    for added in tok_json.get("added_tokens", []):
        if added.get("content") == text:
            return int(added["id"])
    vocab = tok_json.get("model", {}).get("vocab", {})
    return int(vocab[text]) if isinstance(vocab, dict) and text in vocab else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def token_texts_from_json(tok_json: dict[str, Any], vocab_size: int) -> list[str]:
    """Vocabulary in id order: the BPE vocab plus added tokens; ids the tokenizer lacks (a padded
    embedding) get llama.cpp's converter names "[PAD<id>]" so fingerprints agree with its GGUF."""
    by_id: dict[int, str] = {}
    vocab = tok_json.get("model", {}).get("vocab", {})
    if isinstance(vocab, dict):
        by_id.update({int(i): str(t) for t, i in vocab.items()})
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
        by_id.update({i: str(p[0]) for i, p in enumerate(vocab)})
    for added in tok_json.get("added_tokens", []):
        by_id[int(added["id"])] = str(added["content"])
    size = max(vocab_size, max(by_id, default=-1) + 1)
    return [by_id.get(i, f"[PAD{i}]") for i in range(size)]


def tokenizer_from_dir(directory: Path, config: ModelConfig) -> TargetTokenizer:
    from tokenizers import Tokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json")
    tok_json = _read_json(path)
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    model_cfg = _read_json(directory / "config.json")
    gen_cfg = _read_json(directory / "generation_config.json")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = directory / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    eos = set(_ids(gen_cfg.get("eos_token_id"))) | set(_ids(model_cfg.get("eos_token_id")))
    tok_eos = _token_id(tok_json, tok_cfg.get("eos_token"))
    if tok_eos is not None:
        eos.add(tok_eos)
    bos = model_cfg.get("bos_token_id")
    if bos is None:
        bos = _token_id(tok_json, tok_cfg.get("bos_token"))
    return TargetTokenizer(
        Tokenizer.from_file(str(path)),
        token_texts_from_json(tok_json, config.vocab_size),
        template if isinstance(template, str) else None,
        None if bos is None else int(bos),
        sorted(eos),
    )
