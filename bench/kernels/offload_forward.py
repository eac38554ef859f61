"""The forward part of bench.kernels.offload, one child process per resident budget (`python -m
bench.kernels.offload
--child ...`, so that peak RSS is the budget's own): ms per verify forward by rows after a prefix,
with the weight stream's figures (bytes read per forward, the reader's time, the wait, the overlap
at 1 row) and peak RSS. bench/kernels/offload.py's docstring has the method."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GB = 1e9


def layer_bytes_of(model: str, weights: str, shape: str | None, device: str) -> tuple[int, str | None]:
    """The streamable weights' bytes of the target: its layers, and on the CPU a float head of its own
    (offload_head: the budget holds it first, or it streams); and, for --shape, the weight-cache
    entry made for its random weights."""
    from shared.model import offload

    if shape:
        entry = _random_entry(shape, device)
        return _float_bytes(entry, device), str(entry)
    from shared.model import gguf_loader, weight_cache
    from shared.model.target import _gguf_file
    from shared.model.weights import resolve_device, resolve_dtype

    path, _ = _gguf_file(model, True)
    if weights == "quantized":
        reader = gguf_loader.open_gguf(path)
        c = gguf_loader.config_from_gguf(reader)
        return offload.gguf_layout(path, reader, c.num_layers, c.num_heads, c.num_kv_heads).layer_bytes, None
    dev = resolve_device(device)
    entry = weight_cache.entry_dir(path, resolve_dtype("auto", dev))
    if not (entry / "header.json").is_file():  # made by a first streamed load (below, in a child)
        from shared.model import load_target

        load_target(model, offload="disk", resident_gb=0.0)
    return _float_bytes(entry, device), None


def _float_bytes(entry: Path, device: str) -> int:
    """A float-weight cache entry's streamable bytes: the layers' spans and, on the CPU, the head's."""
    from shared.model import disk_io, offload
    from shared.model.offload_head import head_entry
    from shared.model.weights import resolve_device

    head = head_entry(entry) if resolve_device(device).type == "cpu" else None
    layers = offload.float_layout(entry).layer_bytes
    if head is None:
        return layers
    return layers + int(head["shape"][0]) * int(head["shape"][1]) * disk_io._DTYPE_BYTES[head["dtype"]]


def _random_entry(shape: str, device: str) -> Path:
    """A float-weight cache entry of random weights of `shape` (written once per shape and dtype)."""
    import torch

    from bench.kernels.gpu_forward import SHAPES, random_model
    from shared import model_store
    from shared.model import weight_cache
    from shared.model.tokenizer import placeholder_tokenizer
    from shared.model.weights import resolve_device, resolve_dtype

    dev = resolve_device(device)
    dtype = resolve_dtype("auto", dev)
    name = f"random-{shape}-{str(dtype).removeprefix('torch.')}-f{weight_cache.FORMAT}"
    entry = model_store.cache_dir() / "weights" / name
    if not (entry / "header.json").is_file():
        model = random_model(SHAPES[shape], dtype, dev, 0)
        if not weight_cache.save(entry, model, placeholder_tokenizer(), progress=True):
            raise RuntimeError(f"could not write {entry}")
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return entry


def _child_model(args: argparse.Namespace, budget_gb: float, entry_text: str) -> tuple[Any, Any]:
    """The streamed model of one budget (and its StreamedLayers): --model through load_target, or
    --shape's random weights from their cache entry."""
    from shared.model import load_target, offload, weight_cache
    from shared.model.target import _is_projection
    from shared.model.weights import resolve_device, resolve_dtype

    if not args.shape:
        target = load_target(
            args.model,
            device=args.device,
            progress=False,
            weights=args.weights,
            offload=args.offload,
            resident_gb=budget_gb,
            read_threads=args.offload_threads,
        )
        return target.model, target.model.offload
    dev = resolve_device(args.device)
    entry = Path(entry_text)
    hit = weight_cache.load(entry, resolve_dtype("auto", dev), dev, False, skip=_is_projection)
    if hit is None:
        raise RuntimeError(f"cannot read {entry}")
    model = hit[0]
    model.set_attention("model")
    layout = offload.float_layout(entry)
    return model, offload.attach(model, layout, budget_gb, args.offload, args.offload_threads)


def forward_child(args: argparse.Namespace) -> dict[str, Any]:
    """One budget's forward part, in this (child) process: prints and returns its row."""
    import torch

    from bench.kernels.target_step import bench_tree
    from bench.lib.device import sync, to_device
    from shared.model import decode_step, offload, prefill_chunk, tree_round

    # fraction:the verifier's --resident-gb:the KV pool's GB out of it:entry (or empty)
    f_text, budget_text, pool_text, entry_text = args.child.split(":", 3)
    fraction, budget_gb, pool_gb = float(f_text), float(budget_text), float(pool_text)
    t0 = time.perf_counter()
    model, stream = _child_model(args, max(0.0, budget_gb - pool_gb), entry_text)
    load_s = time.perf_counter() - t0
    dev, vocab = model.device, model.config.vocab_size
    prefix = 64
    kv = model.new_kv_cache(-(-(prefix + max(args.rows) + 2) // 16) + 2, 16)
    kv.add(0)
    with torch.inference_mode():
        part = [3 + (i * 7919) % (vocab - 3) for i in range(prefix - 1)]
        model.forward_packed([to_device(prefill_chunk(0, part, 0), dev)], kv)
        kv.commit_rows(0, range(len(part)))
        rows_ms: dict[str, float] = {}
        per_row: dict[str, dict[str, float]] = {}
        for n in args.rows:
            work = (
                tree_round(0, bench_tree(n - 1, prefix, vocab, 0), [5])
                if n > 1
                else decode_step(0, 5, prefix - 1)
            )
            x = to_device(work, dev)
            times = []
            for rep in range(args.repeats + 1):
                stream.reset_stats()
                sync(dev)
                t = time.perf_counter()
                model.forward_packed([x], kv)
                sync(dev)
                if rep:
                    times.append((time.perf_counter() - t) * 1e3)
                kv.discard(0)
            rows_ms[str(n)] = round(statistics.median(times), 2)
            s = stream.stats
            per_row[str(n)] = {"read_ms": round(s.read_s * 1e3, 1), "wait_ms": round(s.wait_s * 1e3, 1)}
    s1 = per_row[str(args.rows[0])]
    overlap = None if s1["read_ms"] <= 0 else round(max(0.0, 1 - s1["wait_ms"] / s1["read_ms"]), 3)
    # the streamed layers and, when it streams too, the head: read in full every forward
    read_bytes = sum(stream.layout.layers[i].nbytes for i in stream.streamed)
    read_bytes += 0 if stream.head is None else stream.head.source.nbytes
    row = {
        "part": "forward",
        "resident_fraction": fraction,
        # the service's --resident-gb at this budget, its KV pool's share (this part makes no pool:
        # its weights get what the service's would) and what is left for the weights
        "resident_gb": round(budget_gb, 3),
        "kv_pool_gb": round(pool_gb, 3),
        "weights_gb": round(max(0.0, budget_gb - pool_gb), 3),
        "layers_resident": len(stream.resident),
        # the weights' share of memory (resident layers, buffers, the head): above resident_gb only
        # when the budget is below what streaming needs
        "held_gb": round(stream.held_bytes / GB, 3),
        "layers": len(stream),
        "head_streamed": stream.head is not None,
        "rows_ms": rows_ms,
        "stream_ms_by_rows": per_row,
        "bytes_per_forward": read_bytes,
        "overlap_1row": overlap,
        # 1.0: a one-row forward costs only its transfer (the compute entirely hidden behind it)
        "forward_over_read_1row": None
        if s1["read_ms"] <= 0
        else round(rows_ms[str(args.rows[0])] / s1["read_ms"], 3),
        "read_mb_s": None if s1["read_ms"] <= 0 else round(read_bytes / s1["read_ms"] / 1e3, 1),
        "load_s": round(load_s, 1),
        "peak_rss_gb": round(offload.peak_rss_bytes() / GB, 3),
    }
    stream.close()
    print(json.dumps(row), flush=True)
    return row


def run_forward_part(
    args: argparse.Namespace, budgets: dict[float, tuple[float, float]], entry: str | None
) -> list[dict[str, Any]]:
    rows = []
    for f in args.resident:
        spec = f"{f!r}:{budgets[f][0]!r}:{budgets[f][1]!r}:{entry or ''}"
        cmd = [sys.executable, "-m", "bench.kernels.offload", "--child", spec, *_child_flags(args)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"the forward run at resident {f} failed:\n{out.stderr[-3000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"forward, resident {f:g}: {row['layers_resident']}/{row['layers']} layers"
            f"{' (head streamed)' if row['head_streamed'] else ''}, ms by rows "
            f"{row['rows_ms']}, overlap at 1 row {row['overlap_1row']}, peak RSS {row['peak_rss_gb']} GB",
            flush=True,
        )
    return rows


def _child_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--model",
        args.model,
        "--weights",
        args.weights,
        "--offload",
        args.offload,
        "--rows",
        ",".join(map(str, args.rows)),
        "--repeats",
        str(args.repeats),
        "--offload-threads",
        str(args.offload_threads),
        "--device",
        args.device,
    ]
    return flags + (["--shape", args.shape] if args.shape else [])
