"""`export`: a trained draft as a GGUF that llama.cpp (and the project's own loader) runs.

The draft's own GGUF is the base: every tensor whose weights training did not change (the token
table and head, frozen blocks) is copied byte for byte, still quantized as it was; a changed
tensor is written from the trained float weights, as F32 or re-quantized to Q8_0 (`--gguf-type`;
re-quantizing to the base's 4-bit type could erase a small update). The fused q|k|v and gate|up
are split back into llama.cpp's tensors, and the q and k rows of `llama`-architecture files are
permuted back into llama.cpp's interleaved order (the loader undoes it; a round-trip test holds
the two together).

`export_lora_gguf` writes a LoRA run's adapters alone as a llama.cpp adapter GGUF (general.type
"adapter", adapter.type "lora", adapter.lora.alpha), applied at run time on the unchanged base
(`edge-client --draft-lora`): the base keeps its 4-bit blocks and the update is not re-quantized
away. Every adapted projection gets `<tensor>.lora_a` [rank, in] and `<tensor>.lora_b` [out, rank]
(llama.cpp adds scale · alpha / rank · B A x); the fused q|k|v and gate|up adapters share their A
and split B by rows, and B's q and k rows are permuted like the base's on `llama` files.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.model.archs import by_name
from shared.model.gguf_loader import hf_name, unpermute_rows
from shared.model.llama import LlamaModel
from shared.model.weights import WeightAssigner
from shared.model_store.derive import copy_fields

GGUF_TYPES = ("f32", "q8_0")
# a Student's LoRA target -> the llama.cpp tensors of one block it adapts (rows of its B, in order)
LORA_TENSORS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's per-head row interleave of q/k (the inverse of `unpermute_rows`)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(model: LlamaModel, base: Path, dst: Path, gguf_type: str = "f32") -> dict[str, Any]:
    """Write `dst` from `base` with `model`'s weights; returns which tensors were rewritten."""
    import gguf
    from gguf.quants import dequantize, quantize

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"--gguf-type must be one of {GGUF_TYPES}, got {gguf_type!r}")
    reader = gguf.GGUFReader(base)
    arch_name = str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())  # type: ignore[union-attr]
    arch = by_name(model.config.architecture)
    if arch_name != arch.name:
        raise ValueError(f"{base} is a {arch_name!r} GGUF but the draft is {arch.name!r}")
    c = model.config
    slots = WeightAssigner(model)
    out_tensors: list[tuple[str, np.ndarray, Any]] = []
    rewritten: list[str] = []
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        target = slots.target(name) if name is not None else None
        shape = [int(n) for n in reversed(t.shape.tolist())]
        if target is None:
            out_tensors.append((t.name, t.data, t.tensor_type))
            continue
        new = target.detach().to(torch.float32).cpu().numpy().reshape(shape)
        heads = c.num_heads if ".q_proj." in str(name) else c.num_kv_heads
        qk = arch.gguf_qk_permuted and (".q_proj." in str(name) or ".k_proj." in str(name))
        old = dequantize(t.data, t.tensor_type).reshape(shape)
        if qk:
            old = unpermute_rows(old, heads)
        if np.array_equal(old.astype(np.float32), new):
            out_tensors.append((t.name, t.data, t.tensor_type))  # unchanged: the base's bytes
            continue
        if qk:
            new = permute_rows(new, heads)
        rewritten.append(t.name)
        if gguf_type == "q8_0" and new.ndim == 2 and new.shape[1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0
            out_tensors.append((t.name, quantize(np.ascontiguousarray(new), kind), kind))
        else:
            out_tensors.append((t.name, np.ascontiguousarray(new), gguf.GGMLQuantizationType.F32))

    def fill(writer: Any) -> None:
        name_key = gguf.Keys.General.NAME
        copy_fields(reader, writer, lambda key, value: f"{value} (distilled)" if key == name_key else value)
        for name, data, kind in out_tensors:
            if kind == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(name, data)
            else:
                writer.add_tensor(name, data, raw_dtype=kind)

    write_gguf(dst, arch_name, fill)
    return {"path": str(dst), "rewritten": rewritten, "copied": len(out_tensors) - len(rewritten)}


def _lora_rows(config: Any, target: str) -> tuple[int, ...]:
    """Rows of each llama.cpp tensor a fused target's B splits into."""
    hd = config.head_dim
    if target == "qkv":
        return (config.num_heads * hd, config.num_kv_heads * hd, config.num_kv_heads * hd)
    if target == "gate_up":
        return (config.intermediate_size, config.intermediate_size)
    return (-1,)


def lora_tensors(
    adapters: dict[str, torch.Tensor], config: Any, arch_name: str
) -> list[tuple[str, np.ndarray]]:
    """(name, array) of the adapter GGUF's tensors from a Student's `{block}_{target}_{a|b}` adapters."""
    arch = by_name(arch_name)
    out: list[tuple[str, np.ndarray]] = []
    for key in sorted(k for k in adapters if k.endswith("_a")):
        block, target = key[:-2].split("_", 1)
        if target not in LORA_TENSORS:
            raise ValueError(f"adapter {key!r}: {target!r} is not one of {', '.join(LORA_TENSORS)}")
        a = adapters[key].detach().to(torch.float32).cpu().numpy()
        b = adapters[f"{block}_{target}_b"].detach().to(torch.float32).cpu().numpy()
        rows = _lora_rows(config, target)
        parts = np.split(b, np.cumsum(rows[:-1])) if len(rows) > 1 else [b]
        for tensor, part in zip(LORA_TENSORS[target], parts, strict=True):
            if arch.gguf_qk_permuted and tensor in ("attn_q", "attn_k"):
                part = permute_rows(part, config.num_heads if tensor == "attn_q" else config.num_kv_heads)
            name = f"blk.{int(block)}.{tensor}.weight"
            out.append((f"{name}.lora_a", np.ascontiguousarray(a)))
            out.append((f"{name}.lora_b", np.ascontiguousarray(part)))
    return out


def export_lora_gguf(
    adapters: dict[str, torch.Tensor], alpha: float, config: Any, base: Path, dst: Path
) -> dict[str, Any]:
    """Write `dst`: the adapters as a llama.cpp LoRA adapter GGUF for `base` (see the module
    docstring); returns the adapted base tensors."""
    import gguf

    reader = gguf.GGUFReader(base)
    arch_name = str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())  # type: ignore[union-attr]
    if arch_name != config.architecture:
        raise ValueError(f"{base} is a {arch_name!r} GGUF but the draft is {config.architecture!r}")
    if not adapters:
        raise ValueError(
            "the run has no LoRA adapters (trained with --lora-rank 0): export it without --lora"
        )
    tensors = lora_tensors(adapters, config, arch_name)
    shapes = {t.name: [int(n) for n in reversed(t.shape.tolist())] for t in reader.tensors}
    for name, arr in tensors:
        weight = name.rsplit(".", 1)[0]
        if weight not in shapes:
            raise ValueError(f"{base} has no tensor {weight}: the adapters were trained on another draft")
        out_f, in_f = shapes[weight]
        if (name.endswith("lora_a") and arr.shape[1] != in_f) or (
            name.endswith("lora_b") and arr.shape[0] != out_f
        ):
            raise ValueError(f"{name} {arr.shape} does not fit {weight} {shapes[weight]}")

    def fill(writer: Any) -> None:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(f"{reader_name(reader)} (LoRA)")
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for name, arr in tensors:
            writer.add_tensor(name, arr)

    write_gguf(dst, arch_name, fill)
    return {"path": str(dst), "adapted": sorted({n.rsplit(".", 1)[0] for n, _ in tensors})}


def write_gguf(dst: Path, arch_name: str, fill: Callable[[Any], None]) -> None:
    """Write `dst` whole or not at all: a GGUFWriter of `arch_name` that `fill` gives its keys and
    tensors, written to a temporary file beside `dst` and renamed over it."""
    import gguf

    fd, tmp_name = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(tmp, arch_name)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def reader_name(reader: Any) -> str:
    """The base GGUF's general.name (or "draft")."""
    import gguf

    f = reader.get_field(gguf.Keys.General.NAME)
    return str(f.contents()) if f is not None else "draft"
