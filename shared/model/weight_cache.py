"""A cache of dequantized weights: the second start of a GGUF target reads floats, not quants.

Dequantizing Qwen2.5-Coder-1.5B's Q4_K/Q6_K tensors with the `gguf` package takes about 40 s on
this CPU; reading the same 7.1 GB of float32 back from the page cache takes a few seconds. The
cache holds, per (model file content, dtype), the model's own fused parameters as raw
little-endian arrays in one file, a JSON header (config, parameter names, shapes, offsets) and
the tokenizer (its `tokenizers` JSON, the stored token texts, chat template, BOS and EOS ids),
so a cached start opens no GGUF at all.

Entries are keyed by `model_store.content_id` (the recorded sha256 of a store file, else the
file's path, size and mtime) and by FORMAT, which changes whenever the layout or the loader's
arithmetic does. An entry is written to a temporary folder and renamed into place, so a reader
never sees half of one; a damaged entry (wrong size, bad header) is ignored and rewritten. The
cache lives in `<treespec cache>/weights/`; `TREESPEC_WEIGHT_CACHE=off` disables it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared import model_store
from shared.model.llama import LlamaModel
from shared.model.model_config import ModelConfig, RopeScaling
from shared.model.tokenizer import TargetTokenizer

log = logging.getLogger("shared.model.weights")

FORMAT = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIGN = 4096  # arrays start on page boundaries (fast reads, and mmap-able if ever wanted)
_READ = 64 << 20  # bytes per read call (keeps the progress bar moving)


def enabled() -> bool:
    return os.environ.get("TREESPEC_WEIGHT_CACHE", "on").lower() not in ("off", "0", "false", "no")


def entry_dir(model_file: Path, dtype: torch.dtype) -> Path:
    name = f"{model_store.content_id(model_file)}-{str(dtype).removeprefix('torch.')}-f{FORMAT}"
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


def _header(model: LlamaModel, tokenizer: TargetTokenizer) -> dict[str, Any]:
    """An entry's header: config, tokenizer metadata, and each parameter's name, shape, dtype and
    page-aligned offset (from names, shapes and dtypes only: no reference to the tensors is kept,
    so a `fill` that frees each parameter once written really gives its memory back)."""
    header: dict[str, Any] = {
        "format": FORMAT,
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
) -> bool:
    """Write `model`'s parameters and `tokenizer` as the entry `entry`; False (logged) on failure,
    e.g. a full disk: the cache is an optimisation, never a reason to fail a start.
    `fill`: the parameters' values come from it (each written as it arrives) instead of `model`,
    whose parameters then only give the names, shapes and dtypes."""
    header = _header(model, tokenizer)
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
                data = p.detach().contiguous().cpu().view(torch.uint8).numpy()
                f.write(data.tobytes() if not data.flags.c_contiguous else data.data)
                bar.update(data.nbytes)
                written.add(name)

            if fill is None:
                for name, p in model.named_parameters(remove_duplicate=True):
                    write(name, p)
            else:
                fill(write)
            if written != set(specs):
                raise ValueError(f"parameters never written: {sorted(set(specs) - written)[:5]}")
            f.truncate(offset)
        (tmp / "tokenizer.json").write_text(tokenizer.tokenizer.to_str(), encoding="utf-8")
        (tmp / "tokens.json").write_text(
            json.dumps(tokenizer.token_texts(), ensure_ascii=False), encoding="utf-8"
        )
        (tmp / "header.json").write_text(json.dumps(header), encoding="utf-8")
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
        return True
    except OSError as exc:
        log.warning("not caching the dequantized weights (%s)", exc)
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(
    entry: Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    skip: Callable[[str], bool] | None = None,
) -> tuple[LlamaModel, TargetTokenizer] | None:
    """The model and tokenizer of a cached entry, or None when there is none (or it is damaged).
    `skip(name)`: parameters left unread (and emptied): the layers a streamed model reads itself."""
    if not (entry / "header.json").is_file():
        return None  # not cached yet
    try:
        header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
        if header.get("format") != FORMAT:
            return None
        data = entry / "weights.bin"
        if data.stat().st_size != header["data_bytes"]:
            log.warning("ignoring the damaged weight cache entry %s (size)", entry)
            return None
        config = _config_from_json(dict(header["config"]))
        tokenizer = _tokenizer(entry, header["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the weight cache entry %s (%s)", entry, exc)
        return None
    from shared.model.weights import build_model

    model = build_model(config, None, dtype, device)
    params = dict(model.named_parameters(remove_duplicate=True))
    specs = header["params"]
    if {s["name"] for s in specs} != set(params):
        log.warning("ignoring the weight cache entry %s (parameters differ)", entry)
        return None
    with (
        data.open("rb", buffering=0) as f,
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
                log.warning("ignoring the weight cache entry %s (%s differs)", entry, s["name"])
                return None
            if skip is not None and skip(s["name"]):
                p.data = p.data.new_empty(0)  # never touched: no memory
                continue
            host = p if p.device.type == "cpu" else torch.empty_like(p, device="cpu")
            buf = host.detach().view(torch.uint8).numpy().data.cast("B")
            f.seek(s["offset"])
            done = 0
            while done < len(buf):
                n = f.readinto(buf[done : done + _READ])
                if not n:
                    log.warning("ignoring the weight cache entry %s (truncated)", entry)
                    return None
                done += n
                bar.update(n)
            if host is not p:
                p.copy_(host)
    return model, tokenizer


def _tokenizer(entry: Path, meta: dict[str, Any]) -> TargetTokenizer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str((entry / "tokenizer.json").read_text(encoding="utf-8"))
    texts = json.loads((entry / "tokens.json").read_text(encoding="utf-8"))
    return TargetTokenizer(tok, texts, meta["chat_template"], meta["bos_id"], meta["eos_ids"])
