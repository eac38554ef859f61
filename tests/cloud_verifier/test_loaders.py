"""Loaders: GGUF (llama.cpp layout, q/k permutation, rope_freqs) and safetensors directories give
the model they were written from; transformers reads the same directories to the same logits;
tokenizer, chat template, EOS ids and the vocabulary fingerprint come through."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.gguf_check import GGUFError
from shared.model import build_model, load_target, smollm2_gguf_path
from shared.model.gguf_loader import config_from_gguf, open_gguf, unpermute_rows
from shared.model.target import streamed_config
from shared.vocab import vocab_fingerprint
from tests.cloud_verifier.checkpoints import (
    MERGES,
    config_for,
    llama_cpp_permute,
    logits_of,
    small_vocab,
    write_gguf,
    write_hf_dir,
)
from tests.shared.gguf_files import MALFORMED, write_tiny_gguf

KINDS = ["llama", "llama3-untied", "qwen2"]
TOKENS = [1, 40, 77, 3, 200, 9, 260, 2, 100, 55, 61, 30, 29, 150, 151]


def test_unpermute_undoes_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    for heads, rows, cols in ((8, 128, 16), (2, 32, 16), (3, 192, 1)):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        assert np.array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)
    b = rng.standard_normal(64).astype(np.float32)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(b, 4), 4), b)


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_round_trip(tmp_path: Path, kind: str) -> None:
    tokens, _ = small_vocab()
    config = config_for(kind, len(tokens))
    model = build_model(config, seed=1, dtype="float32", device="cpu")
    path = tmp_path / "m.gguf"
    write_gguf(path, model, arch="qwen2" if kind == "qwen2" else "llama")
    target = load_target(str(path), progress=False)
    got = target.config
    assert (got.num_heads, got.num_kv_heads, got.head_dim) == (8, 2, 16)
    assert got.tie_embeddings == config.tie_embeddings and got.qkv_bias == config.qkv_bias
    assert (got.rope_scaling is None) == (config.rope_scaling is None)
    diff = (logits_of(target.model, TOKENS) - logits_of(model, TOKENS)).abs().max()
    assert float(diff) <= 1e-5
    assert target.eos_ids == (0, 2) and target.tokenizer.bos_id == 1  # <|endoftext|>, <|im_end|>
    assert target.vocab_fingerprint == vocab_fingerprint(tokens)
    assert target.model_id == "m"


@pytest.mark.parametrize("kind", KINDS)
def test_safetensors_round_trip(tmp_path: Path, kind: str) -> None:
    tokens, _ = small_vocab()
    model = build_model(config_for(kind, len(tokens)), seed=2, dtype="float32", device="cpu")
    write_hf_dir(tmp_path / "ckpt", model, "qwen2" if kind == "qwen2" else "llama")
    target = load_target(str(tmp_path / "ckpt"), progress=False)
    assert target.config == model.config
    assert float((logits_of(target.model, TOKENS) - logits_of(model, TOKENS)).abs().max()) == 0.0
    assert target.eos_ids == (2,)
    assert target.vocab_fingerprint == vocab_fingerprint(tokens)
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "the cat in a hat"}])
    assert text == "<|im_start|>user\nthe cat in a hat<|im_end|>\n<|im_start|>assistant\n"
    ids = target.tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(2) == 1  # special tokens stay whole
    assert target.tokenizer.decode(ids) == text


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_reads_the_same_logits(tmp_path: Path, kind: str) -> None:
    """The reference implementation agrees on GQA, RoPE (with Llama 3 scaling), biases, tying."""
    transformers = pytest.importorskip("transformers")
    tokens, _ = small_vocab()
    model = build_model(config_for(kind, len(tokens)), seed=3, dtype="float32", device="cpu")
    write_hf_dir(tmp_path / "ckpt", model, "qwen2" if kind == "qwen2" else "llama")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([TOKENS])).logits[0]
    got = logits_of(model, TOKENS)
    assert float((got - want).abs().max()) <= 1e-4


def test_tokenizer_round_trips_bytes() -> None:
    from shared.model.tokenizer import bpe_from_gguf

    tokens, types = small_vocab()
    tok = bpe_from_gguf(tokens, MERGES, types, "smollm", 1, True)
    ids = tok.encode("the 2024 café in a hat\n", add_special_tokens=True).ids
    assert ids[0] == 1
    assert tok.decode(ids[1:]) == "the 2024 café in a hat\n"
    assert tokens.index("Ġthe") not in ids  # "the" starts the text: no space before it
    assert tokens.index("Ġin") in ids


def test_smollm2_metadata_tokenizer_and_fingerprint() -> None:
    path = smollm2_gguf_path()
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_embeddings and config.rope_theta == 100000.0
    stored = [
        bytes(reader.fields["tokenizer.ggml.tokens"].parts[i])
        for i in reader.fields["tokenizer.ggml.tokens"].data
    ]
    tiny = load_target("tiny", progress=False)
    assert tiny.vocab_fingerprint == vocab_fingerprint(stored)
    assert tiny.config.vocab_size == 49152 and (tiny.config.num_heads, tiny.config.num_kv_heads) == (8, 2)
    assert tiny.eos_ids == (0, 2) and tiny.model_id == "tiny" and tiny.dtype == torch.float32
    tok = tiny.tokenizer
    assert tok.token_texts()[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12+30?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2
    assert tok.decode(ids) == text
    # SmolLM2 splits every digit (llama.cpp pre-tokenizer "smollm")
    assert tok.encode("hello 12345 world") == [28120, 216, 33, 34, 35, 36, 37, 905]


def test_unknown_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not an alias"):
        load_target(str(tmp_path / "nothing-here"))


# ---------------------------------------------------------------------------------------------------
# Malformed GGUF files: refused by shared.gguf_check before a model is built from the header


@pytest.mark.parametrize("weights", ["fp32", "quantized", "auto"])
@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_gguf_is_refused_before_the_model_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights: str, name: str
) -> None:
    """Every verifier loader (fp32, quantized, auto's choice between them, the streamed config)
    refuses in one line naming the file and what is wrong, and builds nothing: a 5 MB file that
    declares 2^32-1 blocks used to allocate without bound."""
    from shared.model import target as target_module
    from treespec_kernels import quant_matmul

    make, want = MALFORMED[name]
    path = make(tmp_path)

    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built from a header the file does not back")

    monkeypatch.setattr(target_module, "build_model", built)
    monkeypatch.setattr(quant_matmul, "load", lambda: object())  # refusing needs no kernel
    with pytest.raises(GGUFError, match=re.escape(want)) as info:
        load_target(str(path), weights=weights, progress=False)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    with pytest.raises(GGUFError, match=re.escape(want)):
        streamed_config(str(path))


def test_a_gguf_missing_a_tensor_the_model_reads_is_refused(tmp_path: Path) -> None:
    """A header that is consistent with its tensors but lacks one the model needs (here the second
    block's q projection, dropped by renaming it to an unused name) is refused before loading."""
    path = write_tiny_gguf(tmp_path / "m.gguf", blocks=2)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"blk.1.attn_q.weight", b"blk.1.attn_x.weight"))
    with pytest.raises(GGUFError, match=r"tensor 'blk\.1\.attn_q\.weight' missing"):
        load_target(str(path), weights="fp32", progress=False)
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        open_gguf(write_tiny_gguf(tmp_path / "g.gguf", arch="mamba"))


def test_the_verifier_says_what_is_wrong_with_a_gguf_in_one_line(tmp_path: Path) -> None:
    """`cloud-verifier serve --model <a GGUF declaring 2^32-1 blocks>`: exit 1 and one line that
    names the file and the field, no traceback (it used to allocate gigabytes first)."""
    import socket
    import subprocess
    import sys

    make, want = MALFORMED["2^32-1 blocks"]
    path = make(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "cloud_verifier.cli", "serve", "--model", str(path), "--port", port]
    r = subprocess.run(
        [*cmd, "--weights", "fp32", "--no-measure-cost"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cloud-verifier: cannot load model {str(path)!r}: GGUFError: {path}: {want}"), (
        r.stderr
    )
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"])
def test_a_config_with_a_zero_size_is_refused_by_name(field: str) -> None:
    """Whatever it is read from (a GGUF, a config.json, the weight cache's header), a zero size is
    a ValueError naming the field, not a ZeroDivisionError further on or an empty model."""
    from shared.model import make_tiny_config

    with pytest.raises(ValueError, match=f"^{field} must be >= 1, got 0$"):
        make_tiny_config(**{field: 0})
