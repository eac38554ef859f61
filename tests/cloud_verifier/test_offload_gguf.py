"""Streamed weights from the GGUF's blocks and under decoding: tree rows bit-identical to one-token
decoding, the quantized blocks (tiny and SmolLM2) bit for bit, the resident budget kept, a
truncated or corrupt file refused with the layer named (never a wrong token), a slow disk only
slower."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from shared.model import (
    LlamaModel,
    build_model,
    disk_io,
    load_target,
    make_tiny_config,
    offload,
)
from tests.cloud_verifier.offload_helpers import LAYERS, _entry, _logits, _streamed, _tiny_model, _tokens
from tests.cloud_verifier.test_quantized_model import write_llama_gguf
from tests.cloud_verifier.test_tree_forward import check_round
from treespec_kernels import quant_matmul as qm


@pytest.mark.parametrize("seed", range(4))
def test_tree_rows_under_streaming_equal_one_token_decoding(tmp_path: Path, seed: int) -> None:
    model, st = _streamed(_entry(tmp_path, _tiny_model()), tmp_path, 2)
    rng = random.Random(900 + seed)
    check_round(
        model,
        rng,
        prompt_len=rng.randint(2, 40),
        nodes=rng.randint(1, 24),
        tail=rng.randint(1, 3),
        cond=rng.randint(0, 2),
        exact=True,
    )
    assert st.stats.forwards > 3 and st.stats.layers_streamed > 3 * (LAYERS - 2)
    overlap = st.stats.overlap()
    assert overlap is not None and 0.0 <= overlap <= 1.0


@pytest.mark.skipif(qm.load() is None, reason="quant_matmul kernel not built")
def test_gguf_blocks_stream_bit_for_bit(tmp_path: Path) -> None:
    """A `llama` GGUF of Q8_0 blocks (q/k rows permuted as llama.cpp writes them, undone per read)."""
    source = _tiny_model(layers=4, seed=5)
    path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(path, source)
    from shared.model.gguf_loader import config_from_gguf, load_gguf_quantized, open_gguf

    def load() -> LlamaModel:
        reader = open_gguf(path)
        model = build_model(config_from_gguf(reader), None, "float32", "cpu")
        load_gguf_quantized(reader, model, progress=False)
        return model

    want, got = load(), load()
    c = got.config
    layout = offload.gguf_layout(path, open_gguf(path), c.num_layers, c.num_heads, c.num_kv_heads)
    assert layout.kind == "gguf" and all(s.offset % disk_io.ALIGN == 0 for s in layout.layers)
    st = offload.attach(got, layout, 0.0, sidecar=tmp_path / "checksums.json")
    assert st.streamed == [0, 1, 2, 3] and not st.resident
    assert torch.equal(_logits(got, _tokens()), _logits(want, _tokens()))
    rng = random.Random(77)
    check_round(got, rng, prompt_len=20, nodes=12, tail=2, cond=1, exact=True)


@pytest.mark.parametrize("weights", [pytest.param("fp32", marks=pytest.mark.slow), "quantized"])
def test_smollm2_streams_bit_for_bit(weights: str) -> None:
    """The real loader path (`load_target(..., offload="disk")`): the float-weight cache (made on
    first use) or the GGUF's Q4_1 blocks, every layer streamed, against the resident model."""
    if weights == "quantized" and qm.load() is None:
        pytest.skip("quant_matmul kernel not built")
    resident = load_target("smollm2-135m", progress=False, weights=weights).model
    target = load_target("smollm2-135m", progress=False, weights=weights, offload="disk", resident_gb=0.0)
    st = target.model.offload
    assert st is not None and len(st.streamed) == target.config.num_layers
    tokens = _tokens(24, seed=4)
    assert torch.equal(_logits(target.model, tokens), _logits(resident, tokens))
    rng = random.Random(31)
    check_round(target.model, rng, prompt_len=16, nodes=10, tail=1, cond=0, exact=True)
    # what the KV pool is sized from: the buffers and the non-layer state, not the layers
    assert target.model.weight_bytes() < resident.weight_bytes() // 2


def test_the_resident_budget_is_respected(tmp_path: Path) -> None:
    layout = offload.float_layout(_entry(tmp_path, _tiny_model()))
    span, total = layout.max_span, layout.layer_bytes
    for budget in (0, span, 3 * span, 5 * span, total - 1, total, 10 * total):
        keep, buffers = offload.plan_resident(layout, budget, extra_per_buffer=span)
        held = sum(layout.layers[i].nbytes for i in keep)
        if len(keep) == len(layout.layers):
            assert budget >= total and buffers == 0
        else:
            assert buffers == 4 * span
            assert held + buffers <= max(budget, buffers)  # only the buffers may exceed a tiny budget
            assert keep == set(range(len(keep)))  # the first layers stay
    model, st = _streamed(layout.path.parent, tmp_path, 2)
    held = sum(int(b.numel()) for b in st.buffers) + st.resident_bytes
    assert held <= st.budget_bytes and st.held_bytes >= held
    non_layer = sum(p.numel() * p.element_size() for p in model.parameters())
    # the layers held and the non-layer state, plus at most the head's packed copy (oneDNN; the
    # token table itself may be left on disk: offload.TableRows)
    head = model.config.vocab_size * model.config.hidden_size * 4
    assert non_layer + held <= model.weight_bytes() <= non_layer + held + head


def test_a_truncated_file_is_refused_at_start(tmp_path: Path) -> None:
    entry = _entry(tmp_path, _tiny_model())
    data = entry / "weights.bin"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size - 3 * disk_io.ALIGN)
    with pytest.raises(offload.OffloadError, match="truncated"):
        offload.float_layout(entry)
    # a GGUF cut short: the layout names the layer whose blocks run past the end
    path = tmp_path / "t.gguf"
    write_llama_gguf(path, _tiny_model(layers=3))
    from shared.model.gguf_loader import open_gguf
    from shared.model.offload_layout import _check_layers

    reader = open_gguf(path)
    c = make_tiny_config(num_layers=3)
    layout = offload.gguf_layout(path, reader, 3, c.num_heads, c.num_kv_heads)
    del reader
    cut = tmp_path / "cut.gguf"
    shutil.copy(path, cut)
    with cut.open("r+b") as f:
        f.truncate(layout.layers[-1].offset + 100)
    with pytest.raises(offload.OffloadError, match="truncated"):
        _check_layers(layout.layers, cut)


def test_a_corrupt_file_is_refused_and_never_gives_a_wrong_token(tmp_path: Path) -> None:
    entry = _entry(tmp_path, _tiny_model())
    model, st = _streamed(entry, tmp_path, 1)  # records the checksums
    good = _logits(model, _tokens())
    span = st.layout.layers[3]
    data = entry / "weights.bin"

    def flip() -> None:
        with data.open("r+b") as f:
            f.seek(span.offset + span.slots[0].offset + 1000)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))

    flip()
    # while serving: the next read of layer 3 fails loudly instead of computing with it
    with pytest.raises(offload.OffloadError, match="layer 3"):
        for _ in range(3):
            _logits(model, _tokens())
    st.close()
    # at the next start: refused before any forward
    with pytest.raises(offload.OffloadError, match=r"layer 3.*corrupt"):
        _streamed(entry, tmp_path, 1)
    flip()  # repaired: the same logits again
    model, st = _streamed(entry, tmp_path, 1)
    assert torch.equal(_logits(model, _tokens()), good)


def test_a_slow_disk_only_slows(tmp_path: Path) -> None:
    entry = _entry(tmp_path, _tiny_model())
    model, fast = _streamed(entry, tmp_path, 1)
    want = _logits(model, _tokens())
    slow_model, slow = _streamed(entry, tmp_path, 1, delay_s=0.03)
    assert torch.equal(_logits(slow_model, _tokens()), want)
    assert slow.stats.wait_s > fast.stats.wait_s and slow.stats.read_s >= 0.03 * (LAYERS - 1)
