"""shared.gguf_check: a GGUF's header is checked against its tensors and its size before a loader
allocates anything from it. Valid files pass with what gguf-py reads from them; every malformed
one (hostile counts and lengths, a truncated file, misaligned or out-of-file tensors, a header its
tensors do not back) is refused with one line naming the file and the field or tensor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared.gguf_check import ArrayValue, GGUFError, check_gguf
from tests.shared.gguf_files import (
    HIDDEN,
    KV_COUNT_AT,
    KV_HEADS,
    MALFORMED,
    key_at,
    put,
    tensor_dims_at,
    tensor_offset_at,
    tensor_type_at,
    tokens,
    write_tiny_gguf,
)


def _refusal(path: Path) -> str:
    with pytest.raises(GGUFError) as info:
        check_gguf(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def test_a_valid_file_passes_with_what_gguf_py_reads(tmp_path: Path) -> None:
    import gguf

    path = write_tiny_gguf(tmp_path / "ok.gguf")
    header = check_gguf(path)
    assert (header.architecture, header.version, header.alignment) == ("llama", 3, 32)
    assert header.metadata["llama.block_count"] == 1
    assert header.metadata["tokenizer.ggml.tokens"] == ArrayValue(8, len(tokens()))
    assert header.tensors["blk.0.attn_k.weight"].dims == (HIDDEN, KV_HEADS * HIDDEN // 4)
    reader = gguf.GGUFReader(path)
    assert header.data_start == reader.data_offset
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = header.tensors[t.name]
        assert (mine.dims, mine.nbytes) == (tuple(int(d) for d in t.shape), int(t.n_bytes))
        assert header.data_start + mine.offset == t.data_offset


def test_the_packaged_smollm2_passes() -> None:
    from edge_client import models

    try:
        path = models.smollm2_gguf()
    except models.ModelNotFoundError as exc:
        pytest.skip(str(exc))
    header = check_gguf(path)
    assert header.metadata["llama.block_count"] == 30 and len(header.tensors) == 272
    assert header.tensors["token_embd.weight"].dims == (576, 49152)


@pytest.mark.parametrize("name", MALFORMED)
def test_the_malformed_files_every_loader_meets_are_refused(tmp_path: Path, name: str) -> None:
    make, want = MALFORMED[name]
    assert want in _refusal(make(tmp_path))


HEADERS: dict[str, tuple[dict[str, Any], str]] = {
    "fewer blocks held than declared": (
        {"block_count": 2},
        "llama.block_count is 2 but the file holds tensors of 1 block (blk.0)",
    ),
    "more blocks held than declared": (
        {"tensor_blocks": 3},
        "llama.block_count is 1 but the file holds tensors of 3 blocks (blk.0 .. blk.2)",
    ),
    "no block count": ({"block_count": None}, "llama.block_count is missing"),
    "no context": ({"context_length": 0}, "llama.context_length is 0, must be >= 1"),
    "no head count": ({"head_count": None}, "llama.attention.head_count is missing"),
    "kv heads not dividing heads": (
        {"head_count_kv": 3},
        "llama.attention.head_count 4 is not a multiple of head_count_kv 3",
    ),
    "embedding not divisible by heads": (
        {"embedding_length": 66},
        "llama.embedding_length 66 is not divisible by head_count 4",
    ),
    "heads the tensors do not have": (
        {"head_count": 8},
        "tensor 'blk.0.attn_k.weight' has shape [64, 32], the header's hyperparameters give [64, 16]",
    ),
    "a huge embedding": (
        {"embedding_length": 2**31},
        "tensor 'token_embd.weight' has shape [64, 263], the header's hyperparameters give [2147483648, 263]",
    ),
    "a huge feed-forward": ({"feed_forward_length": 2**30}, "tensor 'blk.0.ffn_gate.weight' has shape"),
    "a vocabulary the tokenizer does not have": (
        {"vocab_size": 300},
        "llama.vocab_size is 300 but tokenizer.ggml.tokens has 263 tokens",
    ),
    "alignment not a power of two": ({"alignment": 48}, "general.alignment 48 is not a power of two"),
    "tensors off general.alignment": ({"alignment": 4096}, "breaks general.alignment 4096"),
}


@pytest.mark.parametrize("name", HEADERS)
def test_a_header_its_tensors_do_not_back_is_refused(tmp_path: Path, name: str) -> None:
    options, want = HEADERS[name]
    assert want in _refusal(write_tiny_gguf(tmp_path / "m.gguf", **options))


def _cut(path: Path, drop: int) -> Path:
    path.write_bytes(path.read_bytes()[:-drop])
    return path


def _rename(path: Path, old: bytes, new: bytes) -> Path:
    """Replace the one occurrence of `old` in the file's header by `new` (of the same length)."""
    raw = path.read_bytes()
    assert raw.count(old) == 1 and len(old) == len(new)
    path.write_bytes(raw.replace(old, new))
    return path


Edit = Callable[[Path], Path]
TOKENS = "tokenizer.ggml.tokens"
NORM = "output_norm.weight"
EDITS: dict[str, tuple[Edit, str]] = {
    "magic": (lambda p: put(p, 0, 0x4C4D4747, "<I"), "not a GGUF file (magic b'GGML'"),
    "version 1": (lambda p: put(p, 4, 1, "<I"), "GGUF version 1 is not supported"),
    "big-endian": (lambda p: put(p, 4, 3 << 24, "<I"), "a big-endian GGUF is not supported"),
    "KV count": (lambda p: put(p, KV_COUNT_AT, 2**64 - 1), "KV count 18446744073709551615 cannot fit"),
    "array length": (
        lambda p: put(p, key_at(p, TOKENS) + 4, 2**40),
        "array 'tokenizer.ggml.tokens' of 1099511627776 elements cannot fit",
    ),
    "token string length": (
        lambda p: put(p, key_at(p, TOKENS) + 12, 2**62),
        "element 0 of 'tokenizer.ggml.tokens' is 4611686018427387904 bytes long",
    ),
    "value type": (lambda p: put(p, key_at(p, "llama.block_count") - 4, 99, "<I"), "unknown value type 99"),
    "nested array": (
        lambda p: put(p, key_at(p, "tokenizer.ggml.merges"), 9, "<I"),
        "'tokenizer.ggml.merges' is an array of unknown or nested type 9",
    ),
    "truncated": (lambda p: _cut(p, 100), "tensor 'blk.0.ffn_down.weight' (F32 [128, 64]) ends at byte"),
    "offset past the end": (
        lambda p: put(p, tensor_offset_at(p, NORM), 1 << 40),
        "tensor 'output_norm.weight' (F32 [64]) ends at byte 1099511",
    ),
    "dimension 0": (
        lambda p: put(p, tensor_dims_at(p, NORM), 0),
        "tensor 'output_norm.weight' has shape [0]: every dimension must be >= 1",
    ),
    "dimension 2^62": (lambda p: put(p, tensor_dims_at(p, NORM), 2**62), "past the end of the file"),
    "dimension count": (
        lambda p: put(p, tensor_dims_at(p, NORM) - 4, 2**31, "<I"),
        "tensor 'output_norm.weight' has 2147483648 dimensions (1 to 4)",
    ),
    "duplicate tensor": (
        lambda p: _rename(p, b"blk.0.attn_k.weight", b"blk.0.attn_q.weight"),
        "tensor 'blk.0.attn_q.weight' appears twice",
    ),
    "no architecture": (
        lambda p: _rename(p, b"general.architecture", b"general.architectur_"),
        "general.architecture is missing",
    ),
    "a long architecture": (
        lambda p: _rename(p, b"\x05\0\0\0\0\0\0\0llama", b"\x05\0\0\0\0\0\0\0ll\nma"),
        "general.architecture 'll\\nma' is not an architecture's name",
    ),
    "tensor type": (
        lambda p: put(p, tensor_type_at(p, NORM), 99, "<I"),
        "tensor 'output_norm.weight' has unknown type 99",
    ),
}


@pytest.mark.parametrize("name", EDITS)
def test_hostile_bytes_are_refused(tmp_path: Path, name: str) -> None:
    edit, want = EDITS[name]
    assert want in _refusal(edit(write_tiny_gguf(tmp_path / "m.gguf")))


def test_a_file_shorter_than_a_header_is_refused(tmp_path: Path) -> None:
    for size in (0, 10, 23):
        path = tmp_path / f"{size}.gguf"
        path.write_bytes(b"GGUF\x03\x00\x00\x00"[:size].ljust(size, b"\0"))
        assert f"{size} bytes, shorter than a GGUF header" in _refusal(path)
