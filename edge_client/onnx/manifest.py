"""The manifest of an ONNX export folder and the checks an export passes before it is loaded.

`manifest.json` records what was exported: the source (a draft alias, a GGUF path or `tiny`), its
content id and sha256, vocabulary size and fingerprint, shapes, int8 or not and the int8 layout,
file sizes and every file's checksum (`shared.checksum.file_checksum`), and the format version.
`read_manifest` refuses a manifest of another format, a malformed one, or a folder whose files
fail their checksums; `check_manifest` refuses an export that is not what was asked. Reading a
manifest needs neither torch nor onnx.

Writing an export, and the cache of exports made on first use, are edge_client.onnx.export's (which
re-exports every name here).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = 2  # 2: every file's checksum in the manifest (1 had none)
MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
TINY = "tiny"
MAX_MANIFEST_BYTES = 1 << 20
INT8_LAYOUT = "nbits8-blocks"
DYNAMIC_LAYOUT = "ort-dynamic-qint8"  # onnxruntime's quantize_dynamic (MatMulInteger, per channel)
INT8_METHODS = {"blocks": INT8_LAYOUT, "dynamic": DYNAMIC_LAYOUT}  # export-onnx --int8-method


class ExportError(RuntimeError):
    """An export folder is missing, damaged or does not match what was asked; the message says what to do."""


class OutFolderError(ExportError):
    """The folder to export into may not be replaced (it holds something that is not an export)."""


@dataclass(frozen=True)
class Manifest:
    """manifest.json of an export folder."""

    source: str  # what was exported: an alias, a GGUF path, or "tiny"
    source_id: str  # shared.model_store.content_id of the GGUF ("tiny" for the test model)
    source_sha256: str | None  # sha256 of the GGUF file (model_store.content_sha256; None for "tiny")
    vocab_size: int
    fingerprint: str  # vocabulary fingerprint (PROTOCOL.md section 8)
    int8: bool
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    architecture: str
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None
    files: dict[str, int]  # file name -> size in bytes
    opset: int
    # int8 only: "nbits8-blocks" (export-time 8-bit blocks, MatMulNBits) or "ort-dynamic-qint8"
    # (onnxruntime's quantize_dynamic); None: fp32, or an int8 export from before (quantize_dynamic)
    int8_layout: str | None = None
    format: int = FORMAT
    kv_layout: str = "[rows, layers, kv_heads, head_dim]"
    exported_with: dict[str, str] = field(default_factory=dict)
    # file name -> shared.checksum.file_checksum of it ("xxh3_64:<16 hex digits>"), for every file
    checksums: dict[str, str] = field(default_factory=dict)

    @property
    def kv_row_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.head_dim)


def read_manifest(folder: Path, *, verify: bool = True) -> Manifest:
    """The manifest of an export folder, its files checked against it (their sizes, and with
    `verify` their checksums: a read of every file); ExportError otherwise."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ExportError(
            f"{folder} is not an ONNX export (no {MANIFEST}); make one with "
            f"`edge-client export-onnx --draft ALIAS|PATH --out {folder}`"
        )
    raw = manifest_doc(path)
    if raw.get("format") != FORMAT:
        raise ExportError(
            f"{path}: export format {raw.get('format')!r}, this version reads {FORMAT}; "
            f"re-export with `edge-client export-onnx --out {folder}`"
        )
    _check_fields(raw, path)
    try:
        manifest = Manifest(**raw)
    except TypeError as exc:  # a field missing or unknown
        raise ExportError(f"{path} is not a valid manifest ({exc}); re-export the folder") from exc
    for name, size in manifest.files.items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != size:
            got = f.stat().st_size if f.is_file() else "missing"
            raise ExportError(
                f"{f}: {got}, the manifest says {size} bytes (an interrupted copy?); re-export the folder"
            )
    if set(manifest.checksums) != set(manifest.files):
        raise ExportError(f"{path}: 'checksums' must name the files 'files' names; re-export the folder")
    if verify:
        check_files(manifest, folder)
    return manifest


def check_files(manifest: Manifest, folder: Path) -> None:
    """Refuse (ExportError naming the file) an export whose files are not the bytes it was written
    with: each file's checksum against the manifest's."""
    from shared.checksum import HASH, file_checksum

    flags = (" --int8" if manifest.int8 else "") + (
        " --int8-method dynamic" if manifest.int8_layout == DYNAMIC_LAYOUT else ""
    )
    again = f"export again with `edge-client export-onnx --draft {manifest.source} --out {folder}{flags}`"
    for name in manifest.files:
        f, want = folder / name, manifest.checksums[name]
        kind = want.partition(":")[0]
        if kind != HASH:
            raise ExportError(
                f"{f} has a {kind[:20]!r} checksum, this process computes {HASH} (pip install xxhash); "
                f"or {again}"
            )
        if file_checksum(f) != want:
            raise ExportError(f"{f} fails its checksum (damaged, or changed after the export); {again}")


def plain_name(name: object) -> bool:
    """Whether `name` may be a file of an export folder: a plain file name in the folder itself
    (no separator, not `.`, `..` or hidden, not the manifest)."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
        and name != MANIFEST
    )


def manifest_doc(path: Path) -> dict[str, Any]:
    """manifest.json read as a JSON object whose `files` maps plain names to sizes (ExportError)."""
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ExportError(f"{path}: {path.stat().st_size} bytes, more than a manifest can be; re-export")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ExportError(f"{path} is not a valid manifest ({exc}); re-export the folder") from None
    if not isinstance(raw, dict):
        raise ExportError(f"{path} is not a valid manifest (not a JSON object); re-export the folder")
    files = raw.get("files")
    if not isinstance(files, dict) or MODEL_FILE not in files:
        raise ExportError(f"{path}: 'files' must map the export's file names to their sizes; re-export")
    for name, size in files.items():
        if not plain_name(name) or isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ExportError(
                f"{path}: 'files' names {name[:100]!r} ({size!r}): not a plain file name of the "
                "folder and its size; re-export the folder"
            )
    return raw


def _check_fields(raw: dict[str, Any], path: Path) -> None:
    """Refuse a manifest field of the wrong type (the fields `files` and `format` are checked already)."""

    def count(v: object, lo: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    checks: dict[str, Callable[[object], bool]] = {
        "source": lambda v: isinstance(v, str),
        "source_id": lambda v: isinstance(v, str),
        "source_sha256": lambda v: v is None or isinstance(v, str),
        "fingerprint": lambda v: isinstance(v, str),
        "int8": lambda v: isinstance(v, bool),
        "architecture": lambda v: isinstance(v, str),
        "bos_id": lambda v: v is None or count(v, 0),
        "eos_ids": lambda v: isinstance(v, list) and all(count(i, 0) for i in v),
        "chat_template": lambda v: v is None or isinstance(v, str),
        "int8_layout": lambda v: v is None or isinstance(v, str),
        "checksums": lambda v: isinstance(v, dict) and all(isinstance(c, str) for c in v.values()),
        **{k: lambda v: count(v, 1) for k in _POSITIVE_FIELDS},
    }
    for key, ok in checks.items():
        if key in raw and not ok(raw[key]):
            raise ExportError(f"{path}: {key!r} is {raw[key]!r:.100}, not what an export writes; re-export")


_POSITIVE_FIELDS = ("vocab_size", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "opset")


def check_manifest(
    manifest: Manifest,
    folder: Path,
    *,
    int8: bool | None = None,
    source_id: str | None = None,
    source: str | None = None,
) -> None:
    """Refuse an export that is not what was asked (precision, source file) or is inconsistent.
    source: what it must have been exported from (an alias, a GGUF path or `tiny`): its content id
    and its sha256 (source_sha256) must be the manifest's."""
    if int8 is not None and manifest.int8 != int8:
        want, have = ("int8", "fp32") if int8 else ("fp32", "int8")
        raise ExportError(
            f"{folder} holds an {have} export but {want} was asked; export again with"
            f"{' --int8' if int8 else 'out --int8'} into another folder"
        )
    if source is not None:
        source_id = _source_id(source)
    if source_id is not None and manifest.source_id != source_id:
        raise ExportError(
            f"{folder} was exported from another model file (content id {manifest.source_id}, this "
            f"one is {source_id}); delete the folder or export again with `edge-client export-onnx`"
        )
    sha = None if source is None else source_sha256(source)
    if source is not None and manifest.source_sha256 != sha:
        raise ExportError(
            f"{folder} was exported from another model file (sha256 {str(manifest.source_sha256)[:16]}, "
            f"this one is {str(sha)[:16]}); export again with `edge-client export-onnx`"
        )


def source_path(source: str) -> Path | None:
    """The GGUF behind a draft alias, a target alias or a path (None for `tiny`)."""
    from edge_client.models import DRAFT_ALIASES, resolve_draft
    from shared import model_store
    from shared.model_store.trained import find_trained

    if source == TINY:
        return None
    if source in DRAFT_ALIASES or find_trained(source):
        return resolve_draft(source)
    if source in model_store.ALIASES:
        return model_store.resolve(source, "target")
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ExportError(
        f"{source!r} is not a draft alias ({', '.join(DRAFT_ALIASES)}), a trained draft's name, a target "
        f"alias, {TINY!r} or a .gguf file (the onnx drafter also takes an export-onnx folder)"
    )


def source_id(source: str) -> str:
    """The content id of `source`'s GGUF (`tiny` for the test model), which names its cached exports."""
    from shared import model_store

    path = source_path(source)
    return TINY if path is None else model_store.content_id(path)


def source_sha256(source: str, progress: bool = False) -> str | None:
    """The sha256 of `source`'s GGUF (None for `tiny`): the store's recorded one, else hashed once."""
    from shared import model_store

    path = source_path(source)
    return None if path is None else model_store.content_sha256(path, progress)


def cache_folder(source: str, int8: bool) -> Path:
    """Where the export of `source` made on first use lives in the model cache."""
    from shared import model_store

    kind = f"int8-{INT8_LAYOUT}" if int8 else "fp32"
    return model_store.cache_dir() / "onnx" / f"{source_id(source)}-{kind}-f{FORMAT}"


_source_id = source_id  # for check_manifest, whose argument of that name hides it


def describe(manifest: Manifest) -> dict[str, Any]:
    """A short summary of an export for logs and the CLI."""
    return {
        "source": manifest.source,
        "int8": manifest.int8,
        "int8_layout": manifest.int8_layout,
        "vocab_size": manifest.vocab_size,
        "layers": manifest.num_layers,
        "bytes": sum(manifest.files.values()),
    }
