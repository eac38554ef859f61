"""Where a streamed model's layers lie in a file (shared/model/offload.py): a `Layout` is one byte span
per decoder layer, and where each projection lies in it (`Slot`).

- `float_layout(entry)`: the float-weight cache (shared/model/weight_cache.py), whose parameters
  start on page boundaries and follow each other layer by layer, each with its chunks' checksums.
- `gguf_layout(path, reader, ...)`: a GGUF's own projection blocks.

`plan_resident` says which layers stay in memory within a budget, and what the two stream buffers
take of it. A file shorter than its layout is refused here (OffloadError), before anything streams.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.model.disk_io import _DTYPE_BYTES, ALIGN, CHECK_BYTES, HASH, OffloadError
from treespec_kernels import quant_matmul as qm


@dataclass(frozen=True)
class Slot:
    """One tensor of a layer's span: projection `proj` (0 q|k|v, 1 o, 2 gate|up, 3 down), part
    `order` within it, at `offset` bytes from the span's start.

    kind: "float" (a float32/bf16/fp16 [rows, cols] array) or a GGUF block type name (rows of
    blocks); `permute_heads` > 0 undoes llama.cpp's q/k row interleave for that many heads."""

    proj: int
    order: int
    kind: str
    rows: int
    cols: int
    offset: int
    nbytes: int
    dtype: str = "float32"
    permute_heads: int = 0
    digests: tuple[int, ...] = ()  # float: its CHECK_BYTES chunks' checksums, from the cache entry


@dataclass(frozen=True)
class LayerSpan:
    index: int
    offset: int  # in the file, a multiple of ALIGN
    nbytes: int  # a multiple of ALIGN (may run past the file's end by less than ALIGN)
    slots: tuple[Slot, ...]
    digest: int = 0  # GGUF: of the span's bytes (HASH), 0 until with_checksums (float: per slot)


@dataclass(frozen=True)
class Layout:
    path: Path
    kind: str  # "float" or "gguf"
    file_bytes: int
    layers: tuple[LayerSpan, ...]
    checked: bool = False  # float: every byte was checked against the entry's checksums at load

    @property
    def max_span(self) -> int:
        return max(s.nbytes for s in self.layers)

    @property
    def layer_bytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


def _align_down(n: int) -> int:
    return n // ALIGN * ALIGN


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _span(index: int, tensors: Sequence[tuple[int, int, Slot]]) -> LayerSpan:
    """A layer's span from its tensors' (absolute offset, bytes, slot with offset 0)."""
    start = _align_down(min(o for o, _, _ in tensors))
    end = _align_up(max(o + n for o, n, _ in tensors))
    slots = tuple(Slot(**{**s.__dict__, "offset": o - start, "nbytes": n}) for o, n, s in tensors)
    return LayerSpan(index, start, end - start, slots)


_FLOAT_PROJ = {"qkv": 0, "o": 1, "gate_up": 2, "down": 3}


def float_layout(entry: Path, checked: bool = False) -> Layout:
    """The layout of a float-weight cache entry (its header.json and weights.bin), each projection
    with its checksums from the header. `checked`: weight_cache.load has just checked every byte
    of the file, which the start then reads no second time."""
    try:
        header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
        data = entry / "weights.bin"
        size = data.stat().st_size
    except (OSError, ValueError) as exc:
        raise OffloadError(f"cannot read the float-weight cache entry {entry}: {exc}") from exc
    if (header.get("hash"), header.get("chunk_bytes")) != (HASH, CHECK_BYTES):
        raise OffloadError(
            f"{entry} carries no {HASH} checksums of {CHECK_BYTES}-byte chunks (an older entry, or one "
            "made with another checksum): delete it and start again to rebuild it"
        )
    if size != header.get("data_bytes"):
        raise OffloadError(
            f"{data} is {size} bytes, its header says {header.get('data_bytes')}: truncated or replaced; "
            "delete the entry and start again to rebuild it"
        )
    per_layer: dict[int, list[tuple[int, int, Slot]]] = {}
    for p in header["params"]:
        parts = p["name"].split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in _FLOAT_PROJ:
            continue
        rows, cols = (int(n) for n in p["shape"])
        nbytes = rows * cols * _DTYPE_BYTES[p["dtype"]]
        digests = tuple(int(d) for d in p.get("digests", ()))  # (none: every read of it fails)
        slot = Slot(_FLOAT_PROJ[parts[2]], 0, "float", rows, cols, 0, nbytes, p["dtype"], 0, digests)
        per_layer.setdefault(int(parts[1]), []).append((int(p["offset"]), nbytes, slot))
    layers = tuple(_span(i, per_layer[i]) for i in sorted(per_layer))
    _check_layers(layers, data)
    return Layout(data, "float", size, layers, checked)


def gguf_layout(path: Path, reader: Any, num_layers: int, num_heads: int, num_kv_heads: int) -> Layout:
    """The layout of a GGUF's projection blocks (every projection of a type the kernels read)."""
    from shared.model.archs import by_name
    from shared.model.gguf_loader import _LAYER_NAME, _PROJECTIONS, field, hf_name

    arch = by_name(str(field(reader, "general.architecture")))
    per_layer: dict[int, list[tuple[int, int, Slot]]] = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        hit = _LAYER_NAME.fullmatch(name) if name else None
        if name is None or hit is None or hit.group(2) not in _PROJECTIONS:
            continue
        kind = t.tensor_type.name
        if kind not in qm.QTYPES:
            raise ValueError(f"{t.name} is {kind}: streamed blocks need one of {sorted(qm.QTYPES)}")
        rows, cols = (int(n) for n in reversed(t.shape.tolist()))
        proj, order = _PROJECTIONS[hit.group(2)]
        heads = 0
        if arch.gguf_qk_permuted and hit.group(2).split(".")[1] in ("q_proj", "k_proj"):
            heads = num_heads if "q_proj" in name else num_kv_heads
        slot = Slot(proj, order, kind, rows, cols, 0, int(t.n_bytes), "uint8", heads)
        per_layer.setdefault(int(hit.group(1)), []).append((int(t.data_offset), int(t.n_bytes), slot))
    if sorted(per_layer) != list(range(num_layers)):
        raise OffloadError(
            f"{path}: projection tensors for layers {sorted(per_layer)}, expected {num_layers}"
        )
    layers = tuple(_span(i, per_layer[i]) for i in range(num_layers))
    _check_layers(layers, path)
    return Layout(path, "gguf", path.stat().st_size, layers)


def _check_layers(layers: Sequence[LayerSpan], path: Path) -> None:
    size = path.stat().st_size
    for s in layers:
        need = max(sl.offset + sl.nbytes for sl in s.slots)
        if s.offset + need > size:
            raise OffloadError(
                f"{path} ends at byte {size}, but layer {s.index}'s weights run to {s.offset + need}: "
                "the file is truncated; fetch or rebuild it"
            )


# ---------------------------------------------------------------------------------------------------
# Checksums


def plan_resident(layout: Layout, budget_bytes: int, extra_per_buffer: int = 0) -> tuple[set[int], int]:
    """Which layers stay resident within `budget_bytes` (first ones first), and the bytes the two
    stream buffers take (0 when everything fits). The buffers (each the largest span, plus
    `extra_per_buffer` for a packed copy in flight) come out of the budget."""
    total = layout.layer_bytes
    if budget_bytes >= total:
        return {s.index for s in layout.layers}, 0
    buffers = 2 * (layout.max_span + extra_per_buffer)
    left = budget_bytes - buffers
    keep: set[int] = set()
    for s in layout.layers:
        if s.nbytes > left:
            break
        keep.add(s.index)
        left -= s.nbytes
    return keep, buffers
