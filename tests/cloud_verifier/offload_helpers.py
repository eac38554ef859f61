"""What the streamed-weight tests share: the tiny model and its float-weight cache entry, its logits
and tokens resident and streamed."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from shared.model import (
    LlamaModel,
    build_model,
    make_tiny_config,
    offload,
    prefill,
    weight_cache,
)
from shared.model.tokenizer import placeholder_tokenizer

LAYERS = 8


CPU = torch.device("cpu")


ROOT = Path(__file__).resolve().parents[2]


def _tiny_model(layers: int = LAYERS, seed: int = 3) -> LlamaModel:
    return build_model(make_tiny_config(num_layers=layers), seed, "float32", "cpu")


def _entry(tmp: Path, model: LlamaModel) -> Path:
    entry = tmp / "entry"
    assert weight_cache.save(entry, model, placeholder_tokenizer(), progress=False)
    return entry


def _logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    kv = model.new_kv_cache(64, 16)
    kv.add(0)
    return prefill(model, kv, 0, tokens)


def _tokens(n: int = 30, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(make_tiny_config().vocab_size) for _ in range(n)]


def _streamed(
    entry: Path, tmp: Path, resident_layers: int, **kw: object
) -> tuple[LlamaModel, offload.StreamedLayers]:
    """The tiny model (seed 3) streaming from `entry` with `resident_layers` kept."""
    model = _tiny_model()
    layout = offload.float_layout(entry)
    # oneDNN's packed copy of a layer in flight is budgeted beside each buffer
    budget = (4 * layout.max_span + resident_layers * layout.max_span) / 1e9
    st = offload.attach(model, layout, budget, sidecar=tmp / "checksums.json", **kw)  # type: ignore[arg-type]
    return model, st
