"""Model files derived from others on first use (the 8-block SmolLM2 draft)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.model_store.catalog import ModelStoreError


def copy_fields(
    reader: Any, writer: Any, edit: Callable[[str, Any], Any] = lambda name, value: value
) -> None:
    """Every key-value field of a GGUFReader into a GGUFWriter, each value through `edit(name,
    value)`: not the reader's virtual GGUF.* fields, nor general.architecture (the writer adds it)."""
    import gguf

    for fld in reader.fields.values():
        if fld.name.startswith("GGUF.") or fld.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = fld.types[0]
        sub_type = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(fld.name, edit(fld.name, fld.contents()), vtype, sub_type=sub_type)


def truncated_gguf(src: Path, dst: Path, blocks: int) -> Path:
    """Write `dst`: the GGUF `src` keeping only blocks [0, blocks), the embeddings, output norm and head.

    Tensors are copied as stored (quantized bytes untouched), so the kept layers compute exactly what
    they compute in the full model. The file is written to a temporary name beside `dst` and renamed,
    so a concurrent reader never sees half a file and two writers do not corrupt each other.
    """
    try:
        import gguf  # imported here: resolving a packaged alias needs nothing beyond the stdlib
    except ImportError as exc:
        raise ModelStoreError(
            f"writing {dst.name} needs the `gguf` package: pip install gguf (or treespec[edge])"
        ) from exc

    reader = gguf.GGUFReader(src)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{src} has no general.architecture: not a model GGUF")
    arch = str(arch_field.contents())
    count_key = f"{arch}.block_count"
    count_field = reader.get_field(count_key)
    if count_field is None or int(count_field.contents()) < blocks:
        raise ValueError(f"{src} does not have {blocks} blocks to keep")

    def kept(name: str) -> bool:
        if not name.startswith("blk."):
            return True  # token_embd, output_norm, output (when the head is not tied)
        return int(name.split(".")[1]) < blocks

    tensors = [t for t in reader.tensors if kept(t.name)]
    fd, tmp_name = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(tmp, arch)

        def edit(name: str, value: Any) -> Any:
            if name == count_key:
                return blocks
            return f"{value} (first {blocks} blocks)" if name == gguf.Keys.General.NAME else value

        copy_fields(reader, writer, edit)
        for t in tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        writer.close()
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shared like any downloaded model
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst
