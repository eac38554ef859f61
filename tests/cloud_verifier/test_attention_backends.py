"""The attention backends' registry (shared/model/attention.py): each mode maps to a registered
backend chosen once, a pool without tiled keys is read through SDPA, and a new backend is one
class plus `register` (a counting test double, picked by "model", gives SDPA's logits)."""

from __future__ import annotations

import pytest
import torch

from shared.model import attention, build_model, decode_step, make_tiny_config, prefill, triton_launch
from shared.model.attention import (
    AUTO_ORDER,
    BACKENDS,
    Attend,
    AttentionBackend,
    AttentionSpec,
    ForwardRows,
    Sdpa,
)
from shared.model.kv_cache import PagedKVCache
from shared.model.llama import LlamaModel
from treespec_kernels import cpu_attention


def _model() -> LlamaModel:
    return build_model(make_tiny_config(), seed=0, dtype="float32", device="cpu")


def test_every_mode_maps_to_a_registered_backend() -> None:
    model = _model()
    assert set(AUTO_ORDER) <= set(BACKENDS) and AUTO_ORDER[-1] == "sdpa"
    for mode in attention.ATTENTION_MODES:
        if mode == "triton" and not triton_launch.installed():
            continue
        model.set_attention(mode)
        assert model.attention_backend is BACKENDS[model.attention_kernel]
    model.set_attention("float64")
    assert model.attention_kernel == "sdpa" and model.attn_dtype == torch.float64
    model.set_attention("model")
    want = "cpu-invariant" if cpu_attention.load() is not None else "sdpa"
    assert model.attention_kernel == want
    with pytest.raises(ValueError, match="attention mode must be one of"):
        model.set_attention("flash")
    with pytest.raises(ValueError, match="already registered"):
        attention.register(Sdpa())


def test_a_pool_without_the_kernels_tiled_keys_is_read_through_sdpa() -> None:
    model = _model()
    untiled = PagedKVCache(1, 1, 16, num_blocks=2, block_size=16)
    assert attention.for_pool(BACKENDS["cpu-invariant"], untiled) is BACKENDS["sdpa"]
    assert attention.for_pool(BACKENDS["sdpa"], untiled) is BACKENDS["sdpa"]
    if model.attention_kernel == "cpu-invariant":
        assert model.new_kv_cache(4).kt is not None


class Counting(AttentionBackend):
    """A new backend: SDPA's per-layer function, counting its calls."""

    name = "counting"

    def __init__(self) -> None:
        self.layers: list[int] = []

    def usable(self, spec: AttentionSpec) -> bool:
        return True

    def prepare(self, spec: AttentionSpec, rows: ForwardRows, kv: PagedKVCache) -> Attend:
        inner = BACKENDS["sdpa"].prepare(spec, rows, kv)

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            self.layers.append(layer)
            return inner(q, layer)

        return attend


def test_a_new_backend_is_one_class_and_a_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    model.set_attention("sdpa")
    kv = model.new_kv_cache(16)
    kv.add(0)
    prompt = list(range(5, 30))
    prefill(model, kv, 0, prompt)
    (want,) = model.forward_packed([decode_step(0, 7, len(prompt))], kv)
    kv.discard(0)
    counting = Counting()
    monkeypatch.setattr(attention, "BACKENDS", {**BACKENDS})
    monkeypatch.setattr(attention, "AUTO_ORDER", [])
    attention.register(counting)  # first in "model"'s order
    model.set_attention("model")
    assert model.attention_kernel == "counting"
    (got,) = model.forward_packed([decode_step(0, 7, len(prompt))], kv)
    assert torch.equal(got, want)
    assert counting.layers == list(range(model.config.num_layers))
