"""A cache of dequantized weights: the second start of a GGUF target reads floats, not quants.

Dequantizing Qwen2.5-Coder-1.5B's Q4_K/Q6_K tensors with the `gguf` package takes about 40 s on
this CPU; reading the same 7.1 GB of float32 back from the page cache takes a few seconds. The
cache holds, per (model file content, dtype), the model's own fused parameters as raw
little-endian arrays in one file, a JSON header (config, parameter names, shapes, offsets) and
the tokenizer (its `tokenizers` JSON, the stored token texts, chat template, BOS and EOS ids),
so a cached start opens no GGUF at all.

Entries are keyed by the model file's sha256 (`model_store.content_sha256`: the store's recorded
one, else hashed once per file) and by FORMAT, which changes whenever the layout or the loader's
arithmetic does. An entry is written to a temporary folder and renamed into place, so a reader
never sees half of one.

An entry never serves damaged or swapped data: its header records the sha256 it was made from
(`source`) and a checksum (disk_io.HASH, xxh3-64) of every CHECK_BYTES chunk of every parameter and
of the tokenizer's files, and `load` checks all of them as it reads: a wrong size or header,
another source, or a chunk that fails its checksum makes `load` return None with one log line
saying why, and the caller rebuilds the entry. The check costs one pass of xxh3 over bytes just
read (~20 GB/s here: about 0.35 s for the 1.5B's 7.1 GB). Parameters a streamed start leaves on
disk (`skip`) are read and checked too, then dropped; the streamed layers then check every span
they read against the same checksums (shared/model/offload.py).

The cache lives in `<treespec cache>/weights/`; `TREESPEC_WEIGHT_CACHE=off` disables it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from io import FileIO
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared import model_store
from shared.model.disk_io import CHECK_BYTES, HASH, _digest, chunk_digests, first_bad_chunk
from shared.model.llama import LlamaModel
from shared.model.model_config import ModelConfig, RopeScaling
from shared.model.tokenizer import TargetTokenizer

log = logging.getLogger("shared.model.weights")

FORMAT = 2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIGN = 4096  # arrays start on page boundaries (fast reads, and mmap-able if ever wanted)
_READ = 64 << 20  # bytes per read call (keeps the progress bar moving; a multiple of CHECK_BYTES)
_FILES = ("tokenizer.json", "tokens.json")  # the tokenizer's files, checksummed in the header


def enabled() -> bool:
    return os.environ.get("TREESPEC_WEIGHT_CACHE", "on").lower() not in ("off", "0", "false", "no")


def source_id(model_file: Path, progress: bool = False) -> str:
    """The content identity an entry of `model_file` records and is checked against."""
    return "sha256:" + model_store.content_sha256(model_file, progress)


def entry_dir(model_file: Path, dtype: torch.dtype) -> Path:
    sha = model_store.content_sha256(model_file)
    name = f"{sha[:16]}-{str(dtype).removeprefix('torch.')}-f{FORMAT}"
    return model_store.cache_dir() / "weights" / name


def _config_from_json(raw: dict[str, Any]) -> ModelConfig:
    sc = raw.pop("rope_scaling")
    scaling = None
    if sc is not None:
        if sc.get("freq_factors") is not None:
            sc["freq_factors"] = tuple(sc["freq_factors"])
        scaling = RopeScaling(**sc)
    return ModelConfig(**raw, rope_scaling=scaling)


# fill(write): calls write(name, tensor) once for every parameter, in any order (save_from_gguf)
Filler = Callable[[Callable[[str, torch.Tensor], None]], None]


def _header(model: LlamaModel, tokenizer: TargetTokenizer, source: str | None) -> dict[str, Any]:
    """An entry's header: config, tokenizer metadata, and each parameter's name, shape, dtype and
    page-aligned offset (from names, shapes and dtypes only: no reference to the tensors is kept,
    so a `fill` that frees each parameter once written really gives its memory back). The
    parameters' checksums are added as they are written."""
    header: dict[str, Any] = {
        "format": FORMAT,
        "source": source,
        "hash": HASH,
        "chunk_bytes": CHECK_BYTES,
        "config": asdict(model.config),
        "params": [],
        "tokenizer": {
            "bos_id": tokenizer.bos_id,
            "eos_ids": list(tokenizer.eos_ids),
            "chat_template": tokenizer.chat_template,
        },
    }
    offset = 0
    for name, p in model.named_parameters(remove_duplicate=True):
        header["params"].append(
            {
                "name": name,
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "offset": offset,
            }
        )
        offset += -(-(p.numel() * p.element_size()) // _ALIGN) * _ALIGN
    header["data_bytes"] = offset
    return header


def save(
    entry: Path,
    model: LlamaModel,
    tokenizer: TargetTokenizer,
    progress: bool = True,
    fill: Filler | None = None,
    source: str | None = None,
) -> bool:
    """Write `model`'s parameters and `tokenizer` as the entry `entry`; False (logged) on failure,
    e.g. a full disk: the cache is an optimisation, never a reason to fail a start.
    `fill`: the parameters' values come from it (each written as it arrives) instead of `model`,
    whose parameters then only give the names, shapes and dtypes.
    `source`: what the entry is made from (source_id), recorded for `load` to check."""
    header = _header(model, tokenizer, source)
    offset = header["data_bytes"]
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        free = shutil.disk_usage(tmp).free
        if free < offset + (1 << 30):
            log.warning(
                "not caching the dequantized weights: %.1f GB needed, %.1f GB free in %s",
                offset / 1e9,
                free / 1e9,
                entry.parent,
            )
            return False
        with (
            (tmp / "weights.bin").open("wb") as f,
            tqdm(
                total=offset,
                unit="B",
                unit_scale=True,
                desc="caching dequantized weights",
                disable=not progress,
            ) as bar,
        ):
            specs = {spec["name"]: spec for spec in header["params"]}
            written: set[str] = set()

            def write(name: str, p: torch.Tensor) -> None:
                spec = specs[name]
                if list(p.shape) != spec["shape"]:
                    raise ValueError(f"{name}: shape {list(p.shape)}, expected {spec['shape']}")
                f.seek(spec["offset"])
                data = p.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1).data
                f.write(data)
                spec["digests"] = chunk_digests(data)
                bar.update(len(data))
                written.add(name)

            if fill is None:
                for name, p in model.named_parameters(remove_duplicate=True):
                    write(name, p)
            else:
                fill(write)
            if written != set(specs):
                raise ValueError(f"parameters never written: {sorted(set(specs) - written)[:5]}")
            f.truncate(offset)
        texts = (tokenizer.tokenizer.to_str(), json.dumps(tokenizer.token_texts(), ensure_ascii=False))
        header["files"] = {}
        for name, text in zip(_FILES, texts, strict=True):
            raw = text.encode("utf-8")
            (tmp / name).write_bytes(raw)
            header["files"][name] = _digest(memoryview(raw))
        header["header_digest"] = _header_digest(header)
        (tmp / "header.json").write_text(json.dumps(header), encoding="utf-8")
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
        _drop_other_formats(entry)
        return True
    except OSError as exc:
        log.warning("not caching the dequantized weights (%s)", exc)
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drop_other_formats(entry: Path) -> None:
    """Remove the entry's siblings of other formats (`<name>-f<N>`, N not FORMAT): nothing reads
    them any more (the 1.5B's is 7 GB)."""
    base, sep, _ = entry.name.rpartition("-f")
    if not sep:
        return
    for old in entry.parent.iterdir():
        fmt = old.name.removeprefix(f"{base}-f")
        if old.name.startswith(f"{base}-f") and fmt.isdigit() and int(fmt) != FORMAT and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _header_digest(header: dict[str, Any]) -> int:
    """The checksum of the header's own content (all but this checksum): a config or an offset
    changed in the text is caught like a changed weight."""
    rest = {k: v for k, v in header.items() if k != "header_digest"}
    return _digest(memoryview(json.dumps(rest, sort_keys=True).encode("utf-8")))


def _rebuild(entry: Path, why: str) -> None:
    """The one line a bad entry gets (its caller makes it again)."""
    log.warning("the weight cache entry %s %s: rebuilding it", entry, why)


def _read_header(entry: Path, source: str | None) -> dict[str, Any] | None:
    """The header of a sound entry, or None: none there yet, or (logged) one that cannot be
    trusted: another format, checksum or source, a data file of the wrong size, a tokenizer file
    that fails its checksum."""
    if not (entry / "header.json").is_file():
        return None  # not cached yet
    try:
        header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
        if header.get("format") != FORMAT:
            _rebuild(entry, f"has format {header.get('format')}, this code writes {FORMAT}")
            return None
        if (header.get("hash"), header.get("chunk_bytes")) != (HASH, CHECK_BYTES):
            _rebuild(entry, f"has {header.get('hash')} checksums, this process computes {HASH}")
            return None
        if header.get("header_digest") != _header_digest(header):
            _rebuild(entry, "has a header.json that fails its checksum")
            return None
        if source is not None and header.get("source") != source:
            _rebuild(entry, f"was made from another model file ({header.get('source')}, not {source})")
            return None
        size = (entry / "weights.bin").stat().st_size
        if size != header["data_bytes"]:
            _rebuild(entry, f"has {size} bytes of weights, its header says {header['data_bytes']}")
            return None
        for name in _FILES:
            if _digest(memoryview((entry / name).read_bytes())) != header["files"][name]:
                _rebuild(entry, f"has a {name} that fails its checksum")
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        _rebuild(entry, f"cannot be read ({type(exc).__name__}: {exc})")
        return None
    return dict(header)


def load(
    entry: Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    skip: Callable[[str], bool] | None = None,
    source: str | None = None,
) -> tuple[LlamaModel, TargetTokenizer] | None:
    """The model and tokenizer of a cached entry, every byte checked against the entry's
    checksums; None when there is none, or (logged) when it is damaged or, given `source`, made
    from another model file.
    `skip(name)`: parameters left unread (and emptied): the layers a streamed model reads itself;
    their bytes are still read and checked, then dropped."""
    header = _read_header(entry, source)
    if header is None:
        return None
    try:
        config = _config_from_json(dict(header["config"]))
        tokenizer = _tokenizer(entry, header["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _rebuild(entry, f"cannot be read ({type(exc).__name__}: {exc})")
        return None
    from shared.model.weights import build_model

    model = build_model(config, None, dtype, device)
    params = dict(model.named_parameters(remove_duplicate=True))
    try:
        why = _read_params(entry, header, params, skip, progress)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        why = f"cannot be read ({type(exc).__name__}: {exc})"
    if why is not None:
        _rebuild(entry, why)
        return None
    return model, tokenizer


def _read_params(
    entry: Path,
    header: dict[str, Any],
    params: dict[str, torch.nn.Parameter],
    skip: Callable[[str], bool] | None,
    progress: bool,
) -> str | None:
    """Read every parameter of the entry into `params` (those `skip` names only checked); what is
    wrong with the entry, or None."""
    specs = header["params"]
    if {s["name"] for s in specs} != set(params):
        return "has other parameters than the model"
    scratch: torch.Tensor | None = None
    with (
        (entry / "weights.bin").open("rb", buffering=0) as f,
        tqdm(
            total=header["data_bytes"],
            unit="B",
            unit_scale=True,
            desc="loading cached weights",
            disable=not progress,
        ) as bar,
    ):
        for s in specs:
            p = params[s["name"]]
            if list(p.shape) != s["shape"] or _DTYPES.get(s["dtype"]) != p.dtype:
                return f"has another shape or dtype for {s['name']}"
            nbytes = p.numel() * p.element_size()
            if len(s["digests"]) != -(-nbytes // CHECK_BYTES):
                return f"has {len(s['digests'])} checksums for {s['name']}"
            if skip is not None and skip(s["name"]):
                p.data = p.data.new_empty(0)  # never kept: no memory
                if scratch is None:  # whole chunks, at most _READ
                    size = -(-min(_READ, header["data_bytes"]) // CHECK_BYTES) * CHECK_BYTES
                    scratch = torch.empty(size, dtype=torch.uint8)
                why = _check_unkept(f, s, nbytes, scratch, bar)
            else:
                host = p if p.device.type == "cpu" else torch.empty_like(p, device="cpu")
                why = _read_checked(f, s, host.detach().view(torch.uint8).reshape(-1), bar)
                if why is None and host is not p:
                    p.copy_(host)
            if why is not None:
                return why
    return None


def _read_checked(f: FileIO, spec: dict[str, Any], dst: torch.Tensor, bar: Any, at: int = 0) -> str | None:
    """Read the parameter `spec`'s bytes [at, at + len(dst)) into `dst` (`at` a multiple of _READ)
    and check their chunks; what is wrong, or None."""
    buf = dst.numpy().data.cast("B")
    for done in range(0, len(buf), _READ):
        piece = buf[done : done + _READ]
        f.seek(spec["offset"] + at + done)
        got = 0
        while got < len(piece):
            n = f.readinto(piece[got:])
            if not n:
                return f"is truncated in {spec['name']}"
            got += n
        bar.update(got)
        bad = first_bad_chunk(piece, spec["digests"], (at + done) // CHECK_BYTES)
        if bad is not None:
            first = bad * CHECK_BYTES
            return f"fails its checksum in {spec['name']} (bytes {first}..{first + CHECK_BYTES - 1})"
    return None


def _check_unkept(
    f: FileIO, spec: dict[str, Any], nbytes: int, scratch: torch.Tensor, bar: Any
) -> str | None:
    """Read and check a parameter that is not kept, a scratch buffer at a time."""
    for at in range(0, nbytes, len(scratch)):
        why = _read_checked(f, spec, scratch[: min(len(scratch), nbytes - at)], bar, at)
        if why is not None:
            return why
    if hasattr(os, "posix_fadvise"):  # the stream reads these itself: no need to keep them cached
        os.posix_fadvise(f.fileno(), spec["offset"], nbytes, os.POSIX_FADV_DONTNEED)
    return None


def _tokenizer(entry: Path, meta: dict[str, Any]) -> TargetTokenizer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str((entry / "tokenizer.json").read_text(encoding="utf-8"))
    texts = json.loads((entry / "tokens.json").read_text(encoding="utf-8"))
    return TargetTokenizer(tok, texts, meta["chat_template"], meta["bos_id"], meta["eos_ids"])
