"""The dequantized-weight cache and packing with release: same model, one copy of the weights."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from shared import model_store
from shared.model import build_model, gguf_loader, load_target, weight_cache
from shared.model import target as target_mod
from shared.model.llama import DecoderLayer
from shared.model.weights import hf_state_dict
from tests.fs_faults import after_a_timestamp_tick

from .checkpoints import config_for, logits_of, small_vocab, write_gguf

TOKENS = [1, 504, 3458, 314, 260, 1345, 28, 198, 4093, 42]
SMALL_TOKENS = [1, 40, 100, 7, 200, 3, 150, 9, 260]  # within small_vocab's 266


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


def _param_offset(entry: Path, name: str) -> int:
    header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
    return int(next(p["offset"] for p in header["params"] if p["name"] == name))


def _garble(entry: Path, at: int, n: int = 4096) -> None:
    """Overwrite n bytes of weights.bin at `at` in place: the size stays."""
    data = entry / "weights.bin"
    size = data.stat().st_size
    with data.open("r+b") as f:
        f.seek(at)
        old = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in old))
    assert data.stat().st_size == size


def _truncate(entry: Path) -> None:
    data = entry / "weights.bin"
    data.write_bytes(data.read_bytes()[:-10])


def _change_config(entry: Path, other: Path) -> None:
    text = (entry / "header.json").read_text()
    changed = text.replace('"rope_theta": 10000.0', '"rope_theta": 10001.0')
    assert changed != text
    (entry / "header.json").write_text(changed)


def _swap_whole(entry: Path, other: Path) -> None:
    shutil.rmtree(entry)
    shutil.copytree(other, entry)


DAMAGE: dict[str, tuple[Callable[[Path, Path], object], str]] = {
    "truncated": (lambda e, other: _truncate(e), "bytes of weights"),
    "zero-length": (lambda e, other: (e / "weights.bin").write_bytes(b""), "bytes of weights"),
    "garbled header": (lambda e, other: (e / "header.json").write_text("{garbled"), "cannot be read"),
    "garbage of the same size": (
        lambda e, other: _garble(e, _param_offset(e, "layers.1.down") + 512),
        "fails its checksum in layers.1.down",
    ),
    "another model's weights of the same shapes": (
        lambda e, other: shutil.copy(other / "weights.bin", e / "weights.bin"),
        "fails its checksum in embed",
    ),
    "a config changed in the header": (_change_config, "header.json that fails its checksum"),
    "another tokenizer": (
        lambda e, other: (e / "tokens.json").write_text(json.dumps(["a", "b"])),
        "tokens.json that fails its checksum",
    ),
    "another source's whole entry": (_swap_whole, "made from another model file"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_or_swapped_entry_is_refused_with_one_line_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """Every kind of bad entry makes load return None (the caller rebuilds it) with one log line
    naming what was wrong: a wrong size, a garbled header, bytes changed in place, another model's
    weights of identical shapes, another tokenizer, another source's whole entry."""
    tiny = load_target("tiny", progress=False)
    other = build_model(tiny.config, 1, "float32", "cpu")  # same shapes, other weights
    entry, spare = tmp_path / "entry", tmp_path / "other"
    assert weight_cache.save(entry, tiny.model, tiny.tokenizer, progress=False, source="tiny-seed0")
    assert weight_cache.save(spare, other, tiny.tokenizer, progress=False, source="tiny-seed1")
    cpu = torch.device("cpu")
    assert weight_cache.load(entry, torch.float32, cpu, progress=False, source="tiny-seed0") is not None
    corrupt, says = DAMAGE[damage]
    corrupt(entry, spare)
    for skip in (None, lambda name: True):  # read whole, or (a streamed start) only checked
        caplog.clear()
        with caplog.at_level("WARNING", logger="shared.model.weights"):
            got = weight_cache.load(entry, torch.float32, cpu, progress=False, skip=skip, source="tiny-seed0")
        assert got is None
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and says in lines[0] and "rebuilding it" in lines[0], lines
    assert weight_cache.load(tmp_path / "missing", torch.float32, cpu, progress=False) is None


def test_an_entry_of_another_format_is_removed_when_its_successor_is_written(tmp_path: Path) -> None:
    """The entries a format change leaves behind are deleted (nothing reads them; the 1.5B's is
    7 GB); other entries stay."""
    tiny = load_target("tiny", progress=False)
    fmt = weight_cache.FORMAT
    old, other = tmp_path / f"abc-float32-f{fmt - 1}", tmp_path / f"abd-float32-f{fmt - 1}"
    for d in (old, other, tmp_path / "abc-float32-fine"):
        d.mkdir()
    assert weight_cache.save(tmp_path / f"abc-float32-f{fmt}", tiny.model, tiny.tokenizer, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "abc-float32-f" + str(fmt),
        "abc-float32-fine",
        other.name,
    ]


def _small_gguf(tmp: Path, name: str, seed: int, kind: str = "llama") -> Path:
    """A small GGUF (small_vocab's tokenizer, tiny's layers); those of one kind have equal shapes
    and sizes."""
    tokens, _ = small_vocab()
    path = tmp / name
    write_gguf(path, build_model(config_for(kind, len(tokens)), seed, "float32", "cpu"))
    return path


@pytest.fixture
def gguf_opens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[object]:
    """A scratch cache whose weight cache takes any model, and the GGUF opens of each load."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(target_mod, "CACHE_MIN_PARAMETERS", 0)
    calls: list[object] = []
    real = gguf_loader.open_gguf

    def counted(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(gguf_loader, "open_gguf", counted)
    return calls


def _small_logits(path: Path) -> torch.Tensor:
    return logits_of(load_target(str(path), progress=False).model, SMALL_TOKENS)


def test_garbage_in_the_cached_weights_is_found_and_the_entry_rebuilt(
    tmp_path: Path, gguf_opens: list[object], caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage written into weights.bin at the same size: the next load says so in one line and
    dequantizes the GGUF again (the output is the GGUF's), and the load after reads the rebuilt
    entry."""
    path = _small_gguf(tmp_path, "a.gguf", 1)
    want = _small_logits(path)
    entry = weight_cache.entry_dir(path, torch.float32)
    assert len(gguf_opens) == 1 and (entry / "header.json").is_file()
    _garble(entry, _param_offset(entry, "layers.0.qkv") + 100)
    with caplog.at_level("WARNING", logger="shared.model.weights"):
        got = _small_logits(path)
    assert "fails its checksum in layers.0.qkv" in caplog.text and "rebuilding it" in caplog.text
    assert len(gguf_opens) == 2  # dequantized again
    assert torch.equal(got, want)
    assert torch.equal(_small_logits(path), want) and len(gguf_opens) == 2  # the rebuilt entry


def test_another_models_weights_in_the_entry_are_found_and_the_entry_rebuilt(
    tmp_path: Path, gguf_opens: list[object], caplog: pytest.LogCaptureFixture
) -> None:
    """Two GGUFs of identical shapes: b's weights.bin in a's entry, then b's whole entry in a's
    place. Each is refused with one line (a checksum, then another source) and rebuilt: the
    output stays a's."""
    a, b = _small_gguf(tmp_path, "a.gguf", 1), _small_gguf(tmp_path, "b.gguf", 2)
    want, other = _small_logits(a), _small_logits(b)
    assert not torch.equal(want, other)
    entry_a, entry_b = (weight_cache.entry_dir(p, torch.float32) for p in (a, b))
    assert (entry_a / "weights.bin").stat().st_size == (entry_b / "weights.bin").stat().st_size
    shutil.copy(entry_b / "weights.bin", entry_a / "weights.bin")
    with caplog.at_level("WARNING", logger="shared.model.weights"):
        assert torch.equal(_small_logits(a), want)
    assert "fails its checksum" in caplog.text
    caplog.clear()
    shutil.rmtree(entry_a)
    shutil.copytree(entry_b, entry_a)
    with caplog.at_level("WARNING", logger="shared.model.weights"):
        assert torch.equal(_small_logits(a), want)
    assert "made from another model file" in caplog.text
    assert len(gguf_opens) == 4  # a, b, and a rebuilt twice


def test_a_model_file_rewritten_with_its_old_mtime_gets_its_own_entry(
    tmp_path: Path, gguf_opens: list[object]
) -> None:
    """The entry is keyed by the model file's content: a's file rewritten in place with b's bytes
    (same size) and a's mtime set back is hashed again, and the load gives b's output, not a's
    cached weights."""
    a, b = _small_gguf(tmp_path, "a.gguf", 1), _small_gguf(tmp_path, "b.gguf", 2)
    want_a, want_b = _small_logits(a), _small_logits(b)
    before = a.stat()
    after_a_timestamp_tick(a)
    with a.open("r+b") as f:
        f.write(b.read_bytes())
    os.utime(a, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = a.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    assert model_store.content_sha256(a) == model_store.content_sha256(b)
    got = _small_logits(a)
    assert torch.equal(got, want_b) and not torch.equal(got, want_a)


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
