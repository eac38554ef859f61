"""The verify cost curve: forward milliseconds for N tree nodes, measured at start-up.

The server advertises it in `welcome.verify_cost_ms`; the edge sizes its trees by it (more nodes
while a node costs little, docs/architecture.md §6).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from shared import model_store
from shared.model import SeqInput, Target
from shared.model.kv_cache import PagedKVCache
from shared.tree import TokenTree
from shared.verify_cost import cost_curve_error

DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64)
_PROBE_SEQ = -7  # a sequence id no session uses
log = logging.getLogger("cloud_verifier")


def probe_tree(n: int, base: int, vocab: int) -> TokenTree:
    """A fixed tree of n nodes with the width-4 shape typical of drafted trees."""
    rng = np.random.default_rng(n)
    parents = [-1] + [int(rng.integers(max(-1, i - 4), i)) for i in range(1, n)]
    return TokenTree.build(rng.integers(0, vocab, n), parents, base=base)


def measure_verify_cost(
    target: Target,
    kv: PagedKVCache,
    nodes: Sequence[int] = DEFAULT_NODES,
    prefix: int = 64,
    repeats: int = 3,
) -> dict[int, float]:
    """Forward ms for each N at a committed prefix of `prefix` tokens (row 0 + N nodes): the
    fastest of `repeats` runs after a warm-up (other work on the machine only ever adds time), and
    never more than a larger N's (a forward of fewer rows does not cost more; a curve measured
    while something else ran once advertised 1303 ms for 1 node and 818 for 4)."""
    dev = target.device
    vocab = target.config.vocab_size
    out: dict[int, float] = {}
    kv.add(_PROBE_SEQ)
    try:
        with torch.inference_mode():
            pre = torch.randint(0, vocab, (prefix,), generator=torch.Generator().manual_seed(0))
            target.model.forward_packed(
                [
                    SeqInput(
                        _PROBE_SEQ,
                        pre.to(dev),
                        torch.arange(prefix).to(dev),
                        None,
                        torch.zeros(0, dtype=torch.long).to(dev),
                    )
                ],
                kv,
            )
            kv.commit_rows(_PROBE_SEQ, list(range(prefix - 1)))
            for n in nodes:
                tree = probe_tree(n, prefix, vocab)
                rows = torch.tensor([int(pre[-1]), *tree.tokens.tolist()], dtype=torch.long)
                pos = torch.cat(
                    [torch.tensor([prefix - 1]), torch.from_numpy(tree.positions.astype(np.int64))]
                )
                mask = torch.from_numpy(tree.row_mask())
                inp = SeqInput(
                    _PROBE_SEQ, rows.to(dev), pos.to(dev), mask.to(dev), torch.arange(n + 1).to(dev)
                )
                times = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    target.model.forward_packed([inp], kv)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    times.append((time.perf_counter() - t0) * 1e3)
                    kv.discard(_PROBE_SEQ)
                # the first run warms up; a forward is never free (a curve of 0 ms is refused)
                out[n] = max(round(min(times[1:]), 3), 0.001)
    finally:
        kv.free(_PROBE_SEQ)
    return monotone(out)


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The curve with each N's ms at most any larger N's (a suffix minimum)."""
    out: dict[int, float] = {}
    best = float("inf")
    for n in sorted(curve, reverse=True):
        best = min(best, curve[n])
        out[n] = best
    return {n: out[n] for n in sorted(out)}


def _kernel_paths(weights: str) -> str:
    """The quantized kernel's SIMD paths (AMX from how many rows, or not) and whether the model
    repacked its K types (for which row counts): they change the curve."""
    if weights != "quantized":
        return "-"
    from treespec_kernels import quant_matmul

    packed = "packed rows {}-{}".format(*quant_matmul.packed_rows()) if quant_matmul.packing() else "unpacked"
    return f"{quant_matmul.simd()}; {packed}"


def cost_cache_key(target: Target, threads: int, nodes: Sequence[int], prefix: int) -> str:
    """What a measured curve depends on: the model's weights (and whether its projections are
    quantized), dtype, device and attention, the
    thread count, the CPU (or GPU) model, the probe sizes, and the torch version."""
    dev = target.device
    if dev.type == "cuda":
        hw = torch.cuda.get_device_name(dev)
    else:
        hw = platform.processor() or platform.machine()
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    hw = line.split(":", 1)[1].strip()
                    break
    parts = [
        target.model_id,
        target.vocab_fingerprint,
        str(target.config),
        str(target.dtype),
        dev.type,
        target.model.attention_mode,
        target.model.attention_kernel,
        target.model.weights,  # fp32 or quantized projections
        _kernel_paths(target.model.weights),
        str(threads or torch.get_num_threads()),
        hw,
        ",".join(map(str, nodes)),
        str(prefix),
        torch.__version__,
        "fastest-of-repeats,monotone",  # the method: a curve measured the old way is measured again
    ]
    streamed = getattr(target.model, "offload", None)
    if streamed is not None:  # streamed layers: the transfer is most of a forward's cost
        parts.append(streamed.describe())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def read_cached_cost(path: Path, nodes: Sequence[int]) -> dict[int, float] | str:
    """The curve a cost-cache file holds, or why it cannot be used: missing, unreadable, not a
    usable curve (shared.verify_cost: the rule the client reads the welcome by) or measured at other
    sizes than `nodes`."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "not cached"
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    entries = raw.get("verify_cost_ms") if isinstance(raw, dict) else None
    if not isinstance(entries, dict):
        return "no verify_cost_ms map"
    curve: dict[int, float] = {}
    for k, v in entries.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10):
            return f"{k!r} is not a decimal node count"
        if isinstance(v, bool) or not isinstance(v, int | float):
            return f"{k} nodes: {v!r} is not a number"
        curve[int(k)] = float(v)
    why = cost_curve_error(curve)
    if why is None and sorted(curve) != sorted(nodes):
        why = f"measured at {sorted(curve)} nodes, not {sorted(nodes)}"
    return curve if why is None else why


def cached_verify_cost(
    target: Target,
    kv: PagedKVCache,
    threads: int = 0,
    remeasure: bool = False,
    nodes: Sequence[int] = DEFAULT_NODES,
    prefix: int = 64,
) -> dict[int, float]:
    """The verify cost curve, measured once per (model, machine, settings) and then read back.

    Measuring takes ~30 forwards: a few seconds for SmolLM2, ~25 s for a 1.5B model in fp32 on one
    core, which would double a cached start. The curve is kept in `<treespec cache>/cost/`;
    `remeasure` measures again and replaces it, and so does a cached curve no client could use
    (`read_cached_cost`). A measured curve is checked by the same rule before it is kept or
    advertised (ValueError if it fails).
    """
    path = model_store.cache_dir() / "cost" / f"{cost_cache_key(target, threads, nodes, prefix)}.json"
    if not remeasure:
        cached = read_cached_cost(path, nodes)
        if not isinstance(cached, str):
            return cached
        if cached != "not cached":
            log.warning("the cached verify cost curve %s is not usable: %s; measuring it again", path, cached)
    # streamed layers: a forward's cost is mostly the transfer, steady from one run to the next
    repeats = 1 if getattr(target.model, "offload", None) is not None else 3
    curve = measure_verify_cost(target, kv, nodes, prefix, repeats)
    if (why := cost_curve_error(curve)) is not None:
        raise ValueError(f"the measured verify cost curve {curve} is not usable: {why}")
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": target.model_id, "verify_cost_ms": curve}), encoding="utf-8")
        os.replace(tmp, path)
    return curve
