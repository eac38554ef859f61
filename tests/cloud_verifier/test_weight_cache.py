"""The dequantized-weight cache and packing with release: same model, one copy of the weights."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from shared.model import gguf_loader, load_target, weight_cache
from shared.model import target as target_mod
from shared.model.llama import DecoderLayer
from shared.model.weights import hf_state_dict

from .checkpoints import logits_of

TOKENS = [1, 504, 3458, 314, 260, 1345, 28, 198, 4093, 42]


def test_save_then_load_gives_the_same_model_and_tokenizer(tmp_path: Path) -> None:
    tiny = load_target("tiny", progress=False)
    entry = tmp_path / "entry"
    assert weight_cache.save(entry, tiny.model, tiny.tokenizer, progress=False)
    hit = weight_cache.load(entry, torch.float32, torch.device("cpu"), progress=False)
    assert hit is not None
    model, tok = hit
    assert model.config == tiny.config
    for (name, a), (_, b) in zip(tiny.model.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert tok.token_texts() == tiny.tokenizer.token_texts()
    assert tok.eos_ids == tiny.tokenizer.eos_ids and tok.bos_id == tiny.tokenizer.bos_id
    text = "<|im_start|>user\nHello, 123 world!<|im_end|>"
    assert tok.encode(text) == tiny.tokenizer.encode(text)
    assert tok.chat_template == tiny.tokenizer.chat_template


def test_a_damaged_entry_is_ignored(tmp_path: Path) -> None:
    tiny = load_target("tiny", progress=False)
    entry = tmp_path / "entry"
    assert weight_cache.save(entry, tiny.model, tiny.tokenizer, progress=False)
    data = entry / "weights.bin"
    data.write_bytes(data.read_bytes()[:-10])
    assert weight_cache.load(entry, torch.float32, torch.device("cpu"), progress=False) is None
    assert weight_cache.load(tmp_path / "missing", torch.float32, torch.device("cpu"), progress=False) is None


def test_a_second_load_reads_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(target_mod, "CACHE_MIN_PARAMETERS", 0)
    first = load_target("smollm2-135m", progress=False)
    entries = list((tmp_path / "weights").iterdir())
    assert len(entries) == 1 and (entries[0] / "header.json").is_file()
    calls: list[object] = []
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda *a: calls.append(a))
    second = load_target("smollm2-135m", progress=False)
    assert not calls  # no GGUF opened
    assert second.vocab_fingerprint == first.vocab_fingerprint and second.eos_ids == first.eos_ids
    assert torch.equal(logits_of(first.model, TOKENS), logits_of(second.model, TOKENS))


def test_release_after_packing_keeps_the_logits_and_frees_the_projections() -> None:
    a = load_target("tiny", progress=False)
    b = load_target("tiny", progress=False)
    ref = logits_of(a.model, TOKENS)
    prepared = b.model.prepare(release=True)
    if prepared.gemm.kind != "onednn":
        pytest.skip("the projections are not packed into a copy here (no oneDNN)")
    assert b.model.released
    layers = [cast(DecoderLayer, layer) for layer in b.model.layers]
    assert all(layer.qkv.numel() == 0 and layer.down.numel() == 0 for layer in layers)
    assert b.model.embed.numel() > 0  # the embedding lookup still needs it
    assert torch.equal(logits_of(b.model, TOKENS), ref)
    with pytest.raises(RuntimeError, match="released after packing"):
        hf_state_dict(b.model)
    with pytest.raises(RuntimeError, match="released after packing"):
        b.model.set_gemm("torch")
