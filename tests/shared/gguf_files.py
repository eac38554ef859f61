"""Small GGUF files for the loaders' refusal tests: a one-block Llama with random float weights and
a byte-level BPE vocabulary (llama.cpp loads it), written with gguf-py, and edits of its bytes
(counts, lengths, tensor offsets) that gguf-py would never write.

The hyperparameters are keyword arguments of `write_tiny_gguf` so a test can write a file whose
header disagrees with its tensors (`block_count=0` with one block's tensors, `head_count=0`, ...).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def tokens() -> list[str]:
    return SPECIALS + _byte_chars() + [m.replace(" ", "") for m in MERGES]


def write_tiny_gguf(
    path: Path,
    *,
    blocks: int = 1,
    arch: str = "llama",
    tensor_blocks: int | None = None,
    alignment: int | None = None,
    **hparams: Any,
) -> Path:
    """A GGUF of `blocks` Llama blocks (F32 weights, seeded) at `path`, general.architecture
    `arch`. `hparams` override the header's values (block_count, head_count, head_count_kv,
    embedding_length, context_length, vocab_size, feed_forward_length; None leaves a key out)
    without changing the tensors; `tensor_blocks` writes that many blocks' tensors instead of
    `blocks`; `alignment` writes general.alignment (the data stays laid out on 32 bytes)."""
    import gguf

    toks = tokens()
    rng = np.random.default_rng(0)
    header: dict[str, Any] = {
        "block_count": blocks,
        "context_length": 256,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "head_count": HEADS,
        "head_count_kv": KV_HEADS,
        "vocab_size": len(toks),
        **hparams,
    }
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in header.items():
        if value is not None:
            w.add_uint32(f"{arch}.{key.replace('head_count', 'attention.head_count')}", int(value))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if alignment is not None:
        w.add_uint32("general.alignment", alignment)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(toks) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, *shape: int) -> None:  # shape in numpy order: [rows, columns]
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    add("token_embd.weight", len(toks), HIDDEN)
    add("output_norm.weight", HIDDEN)
    for i in range(blocks if tensor_blocks is None else tensor_blocks):
        add(f"blk.{i}.attn_norm.weight", HIDDEN)
        add(f"blk.{i}.ffn_norm.weight", HIDDEN)
        add(f"blk.{i}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        add(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        add(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------
# Byte edits (GGUF v3, little-endian: magic, version u32, tensor count u64, KV count u64, then the
# KV pairs (key: u64 length + bytes, type u32, value), then each tensor's name, n_dims u32, dims
# u64 each, type u32 and offset u64)

TENSOR_COUNT_AT = 8
KV_COUNT_AT = 16


def put(path: Path, at: int, value: int, fmt: str = "<Q") -> Path:
    """Overwrite the number at byte `at` of `path` (a u64 unless `fmt` says otherwise)."""
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))
    return path


def key_at(path: Path, key: str) -> int:
    """Where the value of metadata key `key` starts (after its length, bytes and type)."""
    raw = path.read_bytes()
    name = struct.pack("<Q", len(key)) + key.encode()
    at = raw.index(name)
    return at + len(name) + 4


def tensor_dims_at(path: Path, name: str) -> int:
    """Where the first u64 dimension of tensor `name`'s header entry is."""
    raw = path.read_bytes()
    entry = struct.pack("<Q", len(name)) + name.encode()
    return raw.index(entry) + len(entry) + 4


def tensor_type_at(path: Path, name: str) -> int:
    """Where the u32 type of tensor `name`'s header entry is."""
    at = tensor_dims_at(path, name)
    (n_dims,) = struct.unpack_from("<I", path.read_bytes(), at - 4)
    return at + 8 * int(n_dims)


def tensor_offset_at(path: Path, name: str) -> int:
    """Where the u64 data offset of tensor `name`'s header entry is."""
    return tensor_type_at(path, name) + 4


def tensor_offset(path: Path, name: str) -> int:
    (value,) = struct.unpack_from("<Q", path.read_bytes(), tensor_offset_at(path, name))
    return int(value)


def header_only(path: Path) -> Path:
    """`path` cut where its tensor data starts: a header whose tensors are all missing."""
    import gguf

    start = int(gguf.GGUFReader(path).data_offset)
    path.write_bytes(path.read_bytes()[:start])
    return path


# malformed files every loader must refuse: name -> (how to write it into a folder, what the
# refusal names)
MALFORMED: dict[str, tuple[Callable[[Path], Path], str]] = {
    "no blocks": (lambda d: write_tiny_gguf(d / "b0.gguf", block_count=0), "llama.block_count is 0"),
    "100000 blocks": (
        lambda d: write_tiny_gguf(d / "b100k.gguf", block_count=100000),
        "llama.block_count is 100000 but the file holds tensors of 1 block",
    ),
    "2^32-1 blocks": (
        lambda d: write_tiny_gguf(d / "bmax.gguf", block_count=2**32 - 1),
        "llama.block_count is 4294967295 but the file holds tensors of 1 block",
    ),
    "no heads": (lambda d: write_tiny_gguf(d / "h0.gguf", head_count=0), "head_count is 0"),
    "no KV heads": (lambda d: write_tiny_gguf(d / "kv0.gguf", head_count_kv=0), "head_count_kv is 0"),
    "string of 2^62 bytes": (
        lambda d: put(p := write_tiny_gguf(d / "s.gguf"), key_at(p, "general.architecture"), 2**62),
        "'general.architecture' is 4611686018427387904 bytes long",
    ),
    "2^32-1 tensors": (
        lambda d: put(write_tiny_gguf(d / "t.gguf"), TENSOR_COUNT_AT, 2**32 - 1),
        "tensor count 4294967295 cannot fit",
    ),
    "header only": (lambda d: header_only(write_tiny_gguf(d / "h.gguf")), "past the end of the file"),
    "misaligned tensor": (
        lambda d: put(
            p := write_tiny_gguf(d / "a.gguf"),
            tensor_offset_at(p, "output_norm.weight"),
            tensor_offset(p, "output_norm.weight") + 4,
        ),
        "breaks general.alignment 32",
    ),
}
