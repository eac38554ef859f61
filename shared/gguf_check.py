"""One validation of a GGUF file before anything is allocated from it or it is handed to llama.cpp.

`check_gguf(path)` reads only the header, with its own parser whose every count and length is
checked against the bytes left in the file before it is used (so a hostile count costs nothing),
and refuses, with a `GGUFError` of one line naming the file and the field or tensor:

- the container: magic and version (2 or 3, little-endian); KV and tensor counts, key, string
  and array lengths that the file cannot hold; unknown value types, nested arrays, duplicate keys
  or tensor names; `general.alignment` that is not a power of two;
- the tensors: 1 to 4 dimensions, each >= 1, a known type whose block divides the first
  dimension, an offset aligned to `general.alignment` and data that ends inside the file;
- the model: `{arch}.block_count` >= 1 and equal to the blocks whose tensors the file holds
  (`blk.0` .. `blk.N-1`, at most llama.cpp's 512), context and embedding lengths >= 1, head and
  KV-head counts >= 1 with the KV heads dividing the heads, the embedding length divisible by the
  heads (when no key length is given), a vocabulary that matches the token-embedding tensor and
  the tokenizer's arrays, and every llama.cpp tensor of the Llama family that is present
  (token_embd, output, the norms, attn_q/k/v/output and their biases, ffn_gate/up/down) of the
  shape those hyperparameters give.

So a model built from the header is the size of the tensors the file holds, and llama.cpp is never
handed a file whose header it would abort on. Loaders that need more (the tensors their model
reads) ask `GGUFHeader.require`. Standard library only: the edge runs it without gguf-py or torch.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name is shorter
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_KEY = 1 << 16  # a metadata key's bytes (keys are short dotted names)

# GGUF metadata value types: id -> (name, struct format of a scalar; "" for string and array)
_STRING, _ARRAY = 8, 9
VALUE_TYPES: dict[int, tuple[str, str]] = {
    0: ("uint8", "<B"),
    1: ("int8", "<b"),
    2: ("uint16", "<H"),
    3: ("int16", "<h"),
    4: ("uint32", "<I"),
    5: ("int32", "<i"),
    6: ("float32", "<f"),
    7: ("bool", "<?"),
    _STRING: ("string", ""),
    _ARRAY: ("array", ""),
    10: ("uint64", "<Q"),
    11: ("int64", "<q"),
    12: ("float64", "<d"),
}
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_FLOAT_TYPES = {6, 12}

# ggml tensor types llama.cpp reads: id -> (name, values per block, bytes per block)
TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _q(value: object) -> str:
    """A name or value read from the file, quoted for a message (cut: a key may be 64 KiB long)."""
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


class GGUFError(ValueError):
    """A GGUF file that no loader may read; the message is one line naming the file and what is wrong."""


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array, as far as the check keeps it: its element type and its length."""

    item_type: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is a row's length (a matrix's input columns)
    type_name: str
    offset: int  # from the start of the data section, aligned
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What `check_gguf` read: scalar and string metadata (arrays as `ArrayValue`), the tensors."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_start: int  # where the data section starts in the file
    file_size: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def error(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def require(self, top: Iterable[str], block: Iterable[str]) -> None:
        """Refuse the file unless it holds every tensor of `top` and, in every block, `blk.N.<name>`
        for every name of `block` (what a loader's model reads)."""
        blocks = self.metadata.get(f"{self.architecture}.block_count", 0)
        names = list(top) + [f"blk.{i}.{b}" for i in range(int(blocks)) for b in block]
        missing = [n for n in names if n not in self.tensors]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise self.error(f"tensor {missing[0]!r}{more} missing (the model needs it)")


def check_gguf(path: str | Path) -> GGUFHeader:
    """The header of the GGUF at `path`, checked as the module docstring says; GGUFError otherwise
    (OSError when the file cannot be read)."""
    header = read_header(path)
    check_model(header)
    return header


# ---------------------------------------------------------------------------------------------------
# The container


class _Cursor:
    """Reads a GGUF header from `buf`, refusing any length that runs past the end of the file."""

    def __init__(self, path: Path, buf: Any, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> int:
        """Advance over `n` bytes of `what`; the offset they start at."""
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, the file has {self.left()} left")
        at, self.pos = self.pos, self.pos + n
        return at

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        n = int(self.scalar("<Q", f"the length of {what}"))
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long, more than {limit}")
        if n > self.left():
            raise self.fail(f"{what} is {n} bytes long, the file has {self.left()} bytes left")
        at = self.take(n, what)
        return bytes(self.buf[at : at + n]).decode("utf-8", "replace")

    def skip_strings(self, count: int, what: str) -> None:
        """Advance over `count` strings (an array's elements: a loop kept lean for 150k tokens)."""
        buf, pos, size = self.buf, self.pos, self.size
        for j in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"element {j} of {what} is cut off by the end of the file")
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
            if n > size - pos:
                raise self.fail(
                    f"element {j} of {what} is {n} bytes long, the file has {size - pos} bytes left"
                )
            pos += n
        self.pos = pos


def read_header(path: str | Path) -> GGUFHeader:
    """The GGUF container's header (metadata and tensor table) at `path`, checked against the file."""
    p = Path(path)
    with open(p, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFError(f"{p}: {size} bytes, shorter than a GGUF header (24 bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(p, buf, size))


def _parse(c: _Cursor) -> GGUFHeader:
    if bytes(c.buf[:4]) != MAGIC:
        raise c.fail(f"not a GGUF file (magic {bytes(c.buf[:4])!r}, expected {MAGIC!r})")
    c.pos = 4
    version = int(c.scalar("<I", "the version"))
    if version not in VERSIONS:
        kind = "a big-endian GGUF" if version & 0xFFFF == 0 else f"GGUF version {version}"
        raise c.fail(f"{kind} is not supported (little-endian versions {VERSIONS})")
    n_tensors, n_kv = int(c.scalar("<Q", "the tensor count")), int(c.scalar("<Q", "the KV count"))
    if n_kv * 13 > c.left():  # a pair: key length (8), type (4), a value of at least 1 byte
        raise c.fail(f"KV count {n_kv} cannot fit in the {c.size} bytes of the file")
    if n_tensors * 24 > c.left():  # a tensor: name length (8), n_dims (4), type (4), offset (8)
        raise c.fail(f"tensor count {n_tensors} cannot fit in the {c.size} bytes of the file")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}", MAX_KEY)
        if key in metadata:
            raise c.fail(f"metadata key {_q(key)} appears twice")
        metadata[key] = _value(c, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment & (alignment - 1)
        or alignment < 1
    ):
        raise c.fail(f"general.alignment {_q(alignment)} is not a power of two")
    raw = [_tensor_entry(c, i) for i in range(n_tensors)]
    data_start = -(-c.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in raw:
        if name in tensors:
            raise c.fail(f"tensor {_q(name)} appears twice")
        tensors[name] = _tensor(c, name, dims, type_id, offset, alignment, data_start)
    return GGUFHeader(c.path, version, metadata, tensors, alignment, data_start, c.size)


def _value(c: _Cursor, key: str) -> Any:
    type_id = int(c.scalar("<I", f"the type of {_q(key)}"))
    if type_id not in VALUE_TYPES:
        raise c.fail(f"metadata {_q(key)} has unknown value type {type_id}")
    if type_id == _STRING:
        return c.string(f"the string {_q(key)}")
    if type_id != _ARRAY:
        return c.scalar(VALUE_TYPES[type_id][1], f"the value of {_q(key)}")
    item = int(c.scalar("<I", f"the element type of {_q(key)}"))
    length = int(c.scalar("<Q", f"the length of {_q(key)}"))
    if item not in VALUE_TYPES or item == _ARRAY:
        raise c.fail(f"metadata {_q(key)} is an array of unknown or nested type {item}")
    each = 8 if item == _STRING else struct.calcsize(VALUE_TYPES[item][1])
    if length * each > c.left():
        raise c.fail(f"array {_q(key)} of {length} elements cannot fit in the {c.left()} bytes left")
    if item == _STRING:
        c.skip_strings(length, _q(key))
    else:
        c.pos += length * each
    return ArrayValue(item, length)


def _tensor_entry(c: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string(f"the name of tensor {i}", MAX_NAME - 1)
    n_dims = int(c.scalar("<I", f"the dimension count of {_q(name)}"))
    if not 1 <= n_dims <= MAX_DIMS:
        raise c.fail(f"tensor {_q(name)} has {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = tuple(int(c.scalar("<Q", f"a dimension of {_q(name)}")) for _ in range(n_dims))
    type_id = int(c.scalar("<I", f"the type of {_q(name)}"))
    offset = int(c.scalar("<Q", f"the offset of {_q(name)}"))
    return name, dims, type_id, offset


def _tensor(
    c: _Cursor, name: str, dims: tuple[int, ...], type_id: int, offset: int, alignment: int, start: int
) -> TensorInfo:
    if any(d < 1 for d in dims):
        raise c.fail(f"tensor {_q(name)} has shape {list(dims)}: every dimension must be >= 1")
    if type_id not in TENSOR_TYPES:
        raise c.fail(f"tensor {_q(name)} has unknown type {type_id}")
    type_name, values, size = TENSOR_TYPES[type_id]
    if dims[0] % values:
        raise c.fail(
            f"tensor {_q(name)} of type {type_name}: rows of {dims[0]} are not whole {values}-value blocks"
        )
    nbytes = math.prod(dims) // values * size
    if offset % alignment:
        raise c.fail(f"tensor {_q(name)} at offset {offset} breaks general.alignment {alignment}")
    end = start + offset + nbytes
    if end > c.size:
        raise c.fail(
            f"tensor {_q(name)} ({type_name} {list(dims)}) ends at byte {end}, past the end of the file "
            f"({c.size} bytes): truncated, or a wrong offset or shape"
        )
    return TensorInfo(name, dims, type_name, offset, nbytes)


# ---------------------------------------------------------------------------------------------------
# The model


def check_model(h: GGUFHeader) -> None:
    """Refuse hyperparameters that are missing, absurd, or disagree with the tensors present."""
    arch = h.metadata.get("general.architecture")
    if arch is None:
        raise h.error("general.architecture is missing")
    if not isinstance(arch, str) or not re.fullmatch(r"[\w.-]{1,64}", arch):
        raise h.error(f"general.architecture {_q(arch)} is not an architecture's name")
    blocks = _count(h, arch, "block_count")
    _check_blocks(h, arch, blocks)
    _count(h, arch, "context_length")
    hidden = _count(h, arch, "embedding_length")
    attention = any(n.endswith((".attn_q.weight", ".attn_k.weight")) for n in h.tensors)
    heads = _count(h, arch, "attention.head_count", need=attention)
    kv = _count(h, arch, "attention.head_count_kv", need=False) or heads
    if heads and kv and heads % kv:
        raise h.error(f"{arch}.attention.head_count {heads} is not a multiple of head_count_kv {kv}")
    key_dim = _count(h, arch, "attention.key_length", need=False)
    if heads and not key_dim:
        if hidden % heads:
            raise h.error(f"{arch}.embedding_length {hidden} is not divisible by head_count {heads}")
        key_dim = hidden // heads
    value_dim = _count(h, arch, "attention.value_length", need=False) or key_dim
    ffn = _count(h, arch, "feed_forward_length", need=any(n.endswith(".ffn_up.weight") for n in h.tensors))
    for key in ("attention.layer_norm_rms_epsilon", "rope.freq_base"):
        v = h.metadata.get(f"{arch}.{key}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
            raise h.error(f"{arch}.{key} is {_q(v)}, must be a positive finite number")

    def times(a: int | None, b: int | None) -> int | None:
        return a * b if a and b else None

    q, k, v_, o = times(heads, key_dim), times(kv, key_dim), times(kv, value_dim), times(heads, value_dim)
    vocab = _vocab(h, arch)
    shapes: dict[str, tuple[int | None, ...]] = {
        "token_embd.weight": (hidden, vocab),
        "output.weight": (hidden, vocab),
        "output_norm.weight": (hidden,),
    }
    per_block: dict[str, tuple[int | None, ...]] = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (hidden, q),
        "attn_k.weight": (hidden, k),
        "attn_v.weight": (hidden, v_),
        "attn_output.weight": (o, hidden),
        "attn_q.bias": (q,),
        "attn_k.bias": (k,),
        "attn_v.bias": (v_,),
        "ffn_gate.weight": (hidden, ffn or None),
        "ffn_up.weight": (hidden, ffn or None),
        "ffn_down.weight": (ffn or None, hidden),
    }
    for i in range(blocks):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in per_block.items()})
    _check_shapes(h, shapes)


def _count(h: GGUFHeader, arch: str, key: str, *, need: bool = True) -> int:
    """`{arch}.{key}`, a whole number >= 1; 0 when it is absent and not needed."""
    v = h.metadata.get(f"{arch}.{key}")
    if v is None:
        if need:
            raise h.error(f"{arch}.{key} is missing")
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        raise h.error(f"{arch}.{key} is {_q(v)}, not a whole number")
    if v < 1:
        raise h.error(f"{arch}.{key} is {v}, must be >= 1")
    return v


def _check_shapes(h: GGUFHeader, shapes: dict[str, tuple[int | None, ...]]) -> None:
    """Every tensor of `shapes` that the file holds has that shape (ggml order; None: any)."""
    for name, want in shapes.items():
        t = h.tensors.get(name)
        if t is None:
            continue
        if len(want) != len(t.dims) or any(
            w is not None and w != d for w, d in zip(want, t.dims, strict=True)
        ):
            shown = ["?" if w is None else w for w in want]
            raise h.error(
                f"tensor {_q(name)} has shape {list(t.dims)}, the header's hyperparameters give {shown}"
            )


def _check_blocks(h: GGUFHeader, arch: str, blocks: int) -> None:
    present = set()
    for name in h.tensors:
        hit = _BLOCK.fullmatch(name)
        if hit is not None:
            present.add(int(hit.group(1)))
    if len(present) != blocks or (present and (min(present) != 0 or max(present) != blocks - 1)):
        span = (
            f"blk.{min(present)}"
            if len(present) == 1
            else f"blk.{min(present, default=0)} .. blk.{max(present, default=0)}"
        )
        held = f"{len(present)} block{'s' if len(present) != 1 else ''} ({span})" if present else "no block"
        raise h.error(f"{arch}.block_count is {blocks} but the file holds tensors of {held}")
    if blocks > MAX_LAYERS:
        raise h.error(f"{arch}.block_count is {blocks}, more than llama.cpp's {MAX_LAYERS}")


def _vocab(h: GGUFHeader, arch: str) -> int | None:
    """The vocabulary size the header gives (vocab_size, else the token list), checked against the
    tokenizer's arrays; None when it gives none."""
    tokens = h.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and not (isinstance(tokens, ArrayValue) and tokens.item_type == _STRING):
        raise h.error("tokenizer.ggml.tokens is not an array of strings")
    n_tokens = None if tokens is None else tokens.length
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        arr = h.metadata.get(key)
        if arr is not None and (not isinstance(arr, ArrayValue) or arr.length != n_tokens):
            raise h.error(f"{key} does not have one entry per token of tokenizer.ggml.tokens ({n_tokens})")
    merges = h.metadata.get("tokenizer.ggml.merges")
    if merges is not None and not (isinstance(merges, ArrayValue) and merges.item_type == _STRING):
        raise h.error("tokenizer.ggml.merges is not an array of strings")
    size = h.metadata.get(f"{arch}.vocab_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise h.error(f"{arch}.vocab_size is {_q(size)}, must be a whole number >= 1")
    if n_tokens is not None and n_tokens < 1:
        raise h.error("tokenizer.ggml.tokens is empty")
    if size is not None and n_tokens is not None and size != n_tokens:
        raise h.error(f"{arch}.vocab_size is {size} but tokenizer.ggml.tokens has {n_tokens} tokens")
    if size is None and n_tokens is None and "token_embd.weight" in h.tensors:
        return h.tensors["token_embd.weight"].dims[-1]  # output.weight must agree with it
    return size if size is not None else n_tokens
