"""Exporting a draft model to ONNX (`edge-client export-onnx`) and the manifest that describes an export.

An export folder holds:

    model.onnx, model.onnx.data   the graph of edge_client.onnx.graph and its weights
    tokenizer.json, tokens.json   the tokenizer (edge_client.stored_tokenizer)
    manifest.json                 what was exported: source and its sha256, vocabulary size and
                                  fingerprint, shapes, int8 or not, file sizes and checksums,
                                  format version

The source is a draft alias, a GGUF path, or `tiny` (the seeded random-weight test model); its
GGUF is dequantized to fp32 by the cloud runtime's loader (`shared.model.load_target`), so
the ONNX model has exactly the torch drafter's weights. `int8` writes every projection, the LM head
and the embedding as symmetric 8-bit blocks of 16-128 input values with one scale each
(edge_client.onnx.quant), quantized while the graph is written, a chunk of rows at a time, and run
by onnxruntime's MatMulNBits with int8 activations; no fp32 graph is written first, so exporting
Qwen2.5-Coder-0.5B needs little more memory than its fp32 torch model. `int8_method="dynamic"`
instead writes the fp32 graph and runs onnxruntime's `quantize_dynamic` over it (int8 weights per
output channel, activations quantized per run: MatMulInteger): faster on wide tree levels, less
accurate, and it needs several times the model's memory while quantizing (over 5.6 GB for the 0.5B).

Exports made on first use live in `<treespec cache>/onnx/<source content id>-<fp32|int8-LAYOUT>-f<FORMAT>/`
(the content id is `shared.model_store.content_id`, as for the verifier's weight cache). Every
folder is written under a temporary name and renamed into place, so a reader never sees half of
one. Exporting needs torch and onnx; reading a manifest needs neither.

An export never loads damaged or swapped: the manifest records every file's checksum
(`shared.checksum.file_checksum`, xxh3-64 over 256 KiB chunks) and the source's sha256
(`model_store.content_sha256`: a store file's recorded one, else hashed once per file). `read_manifest`
checks every file against its checksum, and a cached export also against its source's sha256: a
cached export that fails is exported again with one log line saying why (`ensure_export`); a folder the
user named is refused in one line naming the file. Checking the files costs one read of them: for
Qwen2.5-Coder-0.5B's int8 export (658 MB), 0.27-0.41 s from the page cache on this project's busy
2-core machine (the read ~0.17 s, xxh3 ~0.05 s), once per drafter start.
Manifests of an earlier FORMAT (without checksums) are refused the same way; the cache keeps its
exports in folders named by FORMAT, so an earlier one is simply made again (and the old folder removed).

The manifest itself, reading and checking it, and naming a source's cached export are in
edge_client.onnx.manifest; this module re-exports every name there.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_client.onnx.manifest import (
    DATA_FILE,
    DYNAMIC_LAYOUT,
    FORMAT,
    INT8_LAYOUT,
    INT8_METHODS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MODEL_FILE,
    TINY,
    ExportError,
    Manifest,
    OutFolderError,
    cache_folder,
    check_files,
    check_manifest,
    describe,
    manifest_doc,
    plain_name,
    read_manifest,
    source_id,
    source_path,
    source_sha256,
)

if TYPE_CHECKING:
    from shared.model.model_config import ModelConfig
    from shared.model.tokenizer import TargetTokenizer

log = logging.getLogger("edge_client.onnx")


def export(
    source: str,
    out: Path,
    *,
    int8: bool = False,
    progress: bool = True,
    target: Any = None,
    int8_method: str = "blocks",
    on_stage: Callable[[str], None] | None = None,
) -> Manifest:
    """Export `source` into the folder `out`; returns its manifest. `out` may be missing, empty or
    an earlier export, which is replaced; anything else is refused (check_out_folder).

    target: the already loaded fp32 `shared.model.Target` of `source` (saves loading it
    again, e.g. when the torch drafter holds it); by default it is loaded here.
    int8_method: with int8, "blocks" (8-bit blocks written as the graph is) or "dynamic"
    (onnxruntime's quantize_dynamic over the fp32 graph); see the module docstring.
    on_stage: called with what the export starts doing (loading, writing the graph, ...), e.g. to
    label a progress bar."""
    if int8_method not in INT8_METHODS:
        raise ValueError(f"int8_method {int8_method!r}: one of {', '.join(INT8_METHODS)}")
    _check_source(source)
    check_out_folder(Path(out))  # before the work, and again before the swap
    dynamic = int8 and int8_method == "dynamic"
    stage: Callable[[str], None] = on_stage or (lambda what: None)
    stage("importing torch and onnx")
    import onnx
    import onnxruntime
    import torch

    from shared.model import load_target

    gguf = source_path(source)
    say: Callable[[str], None] = (
        (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    )
    if target is None:
        stage("loading the GGUF (dequantizing to fp32)")
        say(f"export-onnx: loading {source} (dequantizing to fp32)")
        name = str(gguf) if gguf is not None else TINY
        target = load_target(name, dtype="float32", device="cpu", progress=progress)
    elif target.dtype != torch.float32:
        raise ValueError(f"export needs the fp32 model, got {target.dtype}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _scratch_folder(out)
    try:
        from edge_client.onnx.graph import write_model

        kind = "fp32" if not int8 or dynamic else "int8 (8-bit blocks, quantized as written)"
        stage(f"writing the {'int8' if int8 else 'fp32'} graph")
        say(f"export-onnx: writing the {kind} graph ({target.config.num_parameters() / 1e6:.0f}M parameters)")
        graph = tmp / "fp32" / MODEL_FILE if dynamic else tmp / MODEL_FILE
        graph.parent.mkdir(exist_ok=True)
        write_model(target.model, graph, DATA_FILE, int8=int8 and not dynamic)
        config, tok = target.config, target.tokenizer
        fingerprint = str(target.vocab_fingerprint)
        del target
        gc.collect()  # the module graph has reference cycles: free the floats now
        if dynamic:
            stage("quantize_dynamic")
            say("export-onnx: onnxruntime's quantize_dynamic (int8 weights per output channel)")
            _quantize_dynamic(graph, tmp / MODEL_FILE)
            shutil.rmtree(graph.parent)
        stage("writing the tokenizer, hashing the source")
        (tmp / "tokenizer.json").write_text(tok.tokenizer.to_str(), encoding="utf-8")
        (tmp / "tokens.json").write_text(json.dumps(tok.token_texts(), ensure_ascii=False), encoding="utf-8")
        versions = {m.__name__: str(m.__version__) for m in (torch, onnx, onnxruntime)}
        manifest = _manifest(
            source, gguf, config, tok, fingerprint, int8, int8_method, tmp, versions, progress
        )
        (tmp / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1), encoding="utf-8")
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"export-onnx: wrote {out} ({sum(manifest.files.values()) / 1e6:.0f} MB)")
    return manifest


def check_out_folder(out: Path) -> None:
    """Refuse (OutFolderError) an `out` that an export may not replace: `.`, `..`, the working
    folder or one above it, a link, a file, or a folder holding anything but an earlier export
    (its manifest and the files that names). A missing or empty folder is fine."""
    here = Path.cwd().resolve()
    if out.name in ("", ".", "..") or out.resolve() in (here, *here.parents):
        raise OutFolderError(f"{str(out)!r} is the working folder or above it: name a new folder")
    if out.is_symlink():
        raise OutFolderError(f"{out} is a link: name a folder that is not one")
    if not out.exists():
        return
    if not out.is_dir():
        raise OutFolderError(f"{out} is a file, not a folder; nothing was written: name a new folder")
    try:
        entries = {p.name: p for p in out.iterdir()}
    except OSError as exc:
        raise OutFolderError(f"{out} cannot be read ({exc.strerror}): name another folder") from None
    if not entries:
        return
    if MANIFEST not in entries:
        raise OutFolderError(
            f"{out} is not empty and not an ONNX export (no {MANIFEST}); nothing was written or "
            "removed: name a new or empty folder"
        )
    try:
        named = set(manifest_doc(out / MANIFEST)["files"])
    except (ExportError, OSError):
        raise OutFolderError(
            f"{out}/{MANIFEST} is not an export's manifest; nothing was written or removed: name a new or "
            "empty folder"
        ) from None
    others = sorted(n for n, p in entries.items() if n != MANIFEST and (n not in named or not _plain_file(p)))
    if others:
        raise OutFolderError(
            f"{out} holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''} besides an export; "
            "nothing was written or removed: move them, or name another folder"
        )


def _plain_file(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _scratch_folder(out: Path) -> Path:
    """A new hidden folder beside `out` to write the export in (made as mkdir makes folders, so the
    export gets the permissions any new folder gets here)."""
    while True:
        tmp = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the written export `tmp` to `out`, replacing an earlier export there (checked again:
    the folder may have changed while the export ran)."""
    check_out_folder(out)
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f"{tmp.name}.old")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _manifest(
    source: str,
    gguf: Path | None,
    config: ModelConfig,
    tok: TargetTokenizer,
    fingerprint: str,
    int8: bool,
    int8_method: str,
    folder: Path,
    exported_with: dict[str, str],
    progress: bool,
) -> Manifest:
    """The manifest of the export written into `folder` (its files as they are now); hashes the
    source GGUF."""
    from edge_client.onnx.graph import OPSET
    from shared import model_store
    from shared.checksum import file_checksum

    sha = None if gguf is None else model_store.content_sha256(gguf, progress)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return Manifest(
        source=source,
        source_id=TINY if gguf is None else model_store.content_id(gguf),
        source_sha256=sha,
        vocab_size=config.vocab_size,
        fingerprint=fingerprint,
        int8=int8,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_size=config.hidden_size,
        architecture=config.architecture,
        bos_id=tok.bos_id,
        eos_ids=[int(i) for i in tok.eos_ids],
        chat_template=tok.chat_template,
        files={p.name: p.stat().st_size for p in files},
        opset=OPSET,
        int8_layout=INT8_METHODS[int8_method] if int8 else None,
        exported_with=exported_with,
        checksums={p.name: file_checksum(p) for p in files},
    )


def _has_vnni() -> bool:
    """Whether this CPU has an int8 dot-product instruction (AVX-512 VNNI, AVX-VNNI or AMX). Without
    one, onnxruntime's MatMulInteger multiplies u8 x s8 pairs into int16 sums that saturate, and
    full-range int8 weights lose agreement (tiny's top-1 against torch fell from >= 0.9 to 0.875 on
    an AVX2-only EPYC): there the weights take 7 bits (`reduce_range`), as onnxruntime advises. The
    export runs on the device that runs the draft, so its CPU decides."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def _quantize_dynamic(src: Path, dst: Path) -> None:
    """onnxruntime's dynamic quantization of the fp32 graph `src` into `dst`, weights in DATA_FILE."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        src,
        dst,
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=not _has_vnni(),
        use_external_data_format=True,
    )
    if not (dst.parent / DATA_FILE).is_file():
        raise ExportError(
            f"onnxruntime's quantizer wrote no {DATA_FILE} beside {dst}; this onnxruntime is not supported "
            "for --int8-method dynamic (use the default, blocks)"
        )


def _check_source(source: str) -> None:
    """Refuse a malformed source GGUF (shared.gguf_check.GGUFError, one line) before anything loads."""
    from shared.gguf_check import check_gguf

    path = source_path(source)
    if path is not None:
        check_gguf(path)


def ensure_export(source: str, *, int8: bool = False, progress: bool = True) -> Path:
    """The cached export of `source` (an alias or GGUF path), made on first use. A cached one is
    checked (every file's checksum, the source's sha256, precision) and, when it fails, exported
    again with one log line saying why; the folder returned has been checked or just written."""
    from shared.model_store.verify import locked

    _check_source(source)  # also before a cached export of it is used
    folder = cache_folder(source, int8)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with locked(folder):  # two processes asking at once: one exports, the other waits and reads
        if (folder / MANIFEST).is_file():
            why = _cached_export_problem(source, folder, int8)
            if why is None:
                return folder
            log.warning("the cached ONNX export %s cannot be used (%s): exporting it again", folder, why)
            shutil.rmtree(folder, ignore_errors=True)
        _export_on_first_use(source, folder, int8, progress)
        _drop_other_formats(folder)
    return folder


def _cached_export_problem(source: str, folder: Path, int8: bool) -> str | None:
    """What is wrong with the cached export `folder` of `source`, or None when it may be used."""
    try:
        manifest = read_manifest(folder)
        check_manifest(manifest, folder, int8=int8, source=source)
    except (ExportError, OSError) as exc:
        return str(exc)
    return None


def _drop_other_formats(folder: Path) -> None:
    """Remove the cached exports of the same source and precision in other formats
    (`<name>-f<N>`, N not FORMAT): nothing reads them any more."""
    base, sep, _ = folder.name.rpartition("-f")
    for old in folder.parent.glob(f"{base}-f*") if sep else ():
        fmt = old.name.removeprefix(f"{base}-f")
        if fmt.isdigit() and int(fmt) != FORMAT and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)


# First-use estimates for the message before an export, from this project's 2-core x86 machine:
# Qwen2.5-Coder-0.5B Q4_K_M (491 MB) took 43 s on a quiet machine and 68 s on a busy one, and
# peaked at 4.3 GB resident (dequantizing included, no cached fp32 weights)
EXPORT_S_PER_GB = 110.0  # seconds per GB of GGUF
EXPORT_MEMORY_X = 9.0  # peak resident memory per byte of a Q4 GGUF (its fp32 model is ~5x)


def export_estimate(gguf: Path | None) -> tuple[float, float]:
    """(seconds, peak GB) an export of `gguf` (None: `tiny`) may take on a machine like ours."""
    size_gb = 0.0 if gguf is None else gguf.stat().st_size / 1e9
    return max(5.0, EXPORT_S_PER_GB * size_gb), max(0.5, EXPORT_MEMORY_X * size_gb)


def _export_on_first_use(source: str, folder: Path, int8: bool, progress: bool) -> None:
    seconds, gigabytes = export_estimate(source_path(source))
    if progress:
        minutes = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
        print(
            f"edge-client: exporting {source} to ONNX ({'int8' if int8 else 'fp32'}) into {folder}. This "
            f"happens once; later uses load the export. It needs torch and onnx, may take about {minutes} "
            f"(longer on a slower machine) and about {gigabytes:.1f} GB of memory.",
            file=sys.stderr,
            flush=True,
        )
    with _TimeBar(seconds, f"exporting {source}", enabled=progress) as bar:
        export(source, folder, int8=int8, progress=False, on_stage=bar.stage)
    if progress:
        print(f"edge-client: exported {source} in {bar.elapsed:.0f} s", file=sys.stderr, flush=True)


class _TimeBar:
    """A progress bar over an estimated duration: a ticker moves it with the clock (held below
    100% until the work ends), and the label says what the work is doing now."""

    def __init__(self, seconds: float, desc: str, *, enabled: bool) -> None:
        from tqdm import tqdm

        self._desc = desc
        self._total = max(1, round(seconds))
        self._bar = tqdm(
            total=self._total,
            desc=desc,
            disable=not enabled,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} of about {total_fmt} s",
            file=sys.stderr,
        )
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="export-progress", daemon=True)
        self.elapsed = 0.0

    def stage(self, what: str) -> None:
        self._bar.set_description_str(f"{self._desc}: {what}", refresh=False)
        self._advance()

    def _advance(self) -> None:
        shown = min(int(time.monotonic() - self._t0), self._total - 1)  # 100% only when done
        if shown > self._bar.n:
            self._bar.update(shown - self._bar.n)
        else:
            self._bar.refresh()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._advance()

    def __enter__(self) -> _TimeBar:
        self._ticker.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._stop.set()
        self._ticker.join()
        self.elapsed = time.monotonic() - self._t0
        if exc_type is None:
            self._bar.set_description_str(f"{self._desc}: done", refresh=False)
            self._bar.update(self._total - self._bar.n)
        self._bar.close()


__all__ = [
    "DATA_FILE",
    "DYNAMIC_LAYOUT",
    "EXPORT_MEMORY_X",
    "EXPORT_S_PER_GB",
    "FORMAT",
    "INT8_LAYOUT",
    "INT8_METHODS",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "MODEL_FILE",
    "TINY",
    "ExportError",
    "Manifest",
    "OutFolderError",
    "cache_folder",
    "check_files",
    "check_manifest",
    "check_out_folder",
    "describe",
    "ensure_export",
    "export",
    "export_estimate",
    "manifest_doc",
    "plain_name",
    "read_manifest",
    "source_id",
    "source_path",
    "source_sha256",
]
