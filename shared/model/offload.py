"""Streamed weights: a target larger than memory (SpecInfer §5.4's offloading-based verification).

`cloud-verifier serve --offload disk|host --resident-gb N` keeps up to N GB of decoder layers in
memory and streams the other layers' projection weights in for every forward, the next layer read
ahead on a background thread while the current one computes (double buffering). A tree of τ
tokens verified in one streamed pass pays the transfer once for τ tokens, where one-token decoding
pays it for every token: that is the speed-up this mode is for.

Sources (a `Layout`: one byte span per layer in a file, and where each projection lies in it):

- `float_layout(entry)`: the float-weight cache (shared/model/weight_cache.py), whose parameters
  start on page boundaries and follow each other layer by layer. Streamed layers are packed for
  the CPU's projection kernels on the background thread, exactly as a resident model packs them
  once, so logits are bit-identical to the resident model's.
- `gguf_layout(path, reader, config)`: the GGUF's own blocks (`--weights quantized`, about six
  times fewer bytes): the projections are views of the read buffer, run by the same quantized
  kernels as resident blocks.

Modes: `disk` reads each streamed span with O_DIRECT (the page cache is bypassed, so the measured
cost is the storage's, not RAM's; several reader threads split a span when `read_threads` > 1);
`host` keeps every streamed span in host memory (pinned on a GPU host) and copies it into the
working buffer (on a GPU, on a side CUDA stream with an event the compute stream waits on; on a
CPU a memcpy, the same interface).

Integrity (xxh3-64, or CRC-32 without xxhash): a float-weight cache entry carries the checksums of
its parameters' chunks, written with it when it is made (weight_cache), so a file rewritten or
damaged since is never taken for the truth: its spans are checked against those at start (by
weight_cache.load when it has just read them: `float_layout(entry, checked=True)`, else here) and
on every read on the reader thread. A GGUF's spans are checksummed the first time it streams (a
sidecar keyed by the file's content id) and checked the same way. A truncated file is refused at
start, a corrupt span (at start or later) raises `OffloadError` naming the layer, never a wrong
token. On the CPU, float weights' token table stays in the file too (TableRows: a forward reads its
tokens' rows), and so does a head of its own (offload_head): packed into memory a chunk at a time
when it fits the budget, else streamed every forward in chunks like a layer. Norms and biases stay
resident.

The resident budget covers the head (first, when it fits: it is read every forward), the resident
layers and the stream buffers (two layers' spans, plus, for float weights, two packed layers in
flight; a streamed head's two chunks and one packed chunk); layers are kept resident from the first
one on.

The modules: offload_layout (the layouts, plan_resident), offload_integrity (the checksums),
offload_stream (StreamedLayers, stream), offload_table (TableRows), offload_head (the head); this
one attaches a stream to a model (`attach`) and re-exports their public names.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.model.disk_io import OffloadError, StreamStats
from shared.model.offload_integrity import check_span, verify_all, with_checksums
from shared.model.offload_layout import LayerSpan, Layout, Slot, float_layout, gguf_layout, plan_resident
from shared.model.offload_stream import OFFLOAD_MODES, StreamedLayers, materialize, stream
from shared.model.offload_table import TableRows, table_on_disk

log = logging.getLogger("shared.model.offload")


def _no_float_slots(w: torch.Tensor) -> Any:
    raise AssertionError("block layouts have no float slots")


def attach(
    model: Any,
    layout: Layout,
    resident_gb: float,
    mode: str = "disk",
    read_threads: int = 2,
    verify: bool = True,
    progress: bool = False,
    delay_s: float = 0.0,
    direct: bool = True,
    sidecar: Path | None = None,
) -> StreamedLayers:
    """Make `model` (a LlamaModel) stream its layers' projections from `layout`, keeping up to
    `resident_gb` GB of them (and the stream buffers) in memory. Float weights are packed for the
    model's projection kernels as `prepare` would; quantized weights stay blocks. The model's own
    float projections are freed (they may never have been read: weight_cache.load's `skip`)."""
    from shared.model.llama import DecoderLayer, Gemm, _Prepared, choose_gemm

    if resident_gb < 0:
        raise ValueError(f"resident_gb must be >= 0, got {resident_gb}")
    if model.weights == "quantized":
        if layout.kind != "gguf":
            raise ValueError("a model on quantized weights streams a GGUF's blocks (gguf_layout)")
        prep = model.prepare()
        gemm, head = prep.gemm, prep.lm_head
        pack: Callable[[torch.Tensor], Any] = _no_float_slots
        packed_copy = False
    else:
        if layout.kind != "float":
            raise ValueError("a model on float weights streams the float-weight cache (float_layout)")
        gemm = Gemm(choose_gemm(model.gemm_kind, model.device, model.dtype))
        pack, packed_copy = gemm.pack, gemm.kind == "onednn"
    budget = int(resident_gb * 1e9)
    head_file = None
    if model.weights != "quantized":
        entry = layout.path.parent
        need = buffers_needed(layout, packed_copy)
        head, budget, head_file = _float_head(
            model, gemm, entry, budget, need, layout.checked, direct, progress
        )
    # the token table goes back to disk before the resident layers and buffers are filled: the
    # peak holds the table and the head's packed copy, or the head and the layers, never all three
    table = (
        table_on_disk(model, head, layout.path.parent, layout.checked, progress)
        if layout.kind == "float"
        else None
    )
    streamed = stream(
        layout,
        budget,
        pack,
        mode,
        model.device,
        read_threads,
        verify,
        progress,
        delay_s,
        direct,
        packed_copy,
        sidecar,
    )
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
            p.data = p.data.new_empty(0)
    full = streamed.budget_bytes = int(resident_gb * 1e9)  # the head's share included
    if head_file is not None:
        from shared.model.offload_head import StreamedRows

        head = streamed.head = StreamedRows(head_file, gemm.pack, lambda: streamed.stats, streamed._lock)
    _account(streamed, head_file.stream_bytes if head_file is not None else full - budget, packed_copy)
    model._prepared = _Prepared(gemm, streamed, head)
    model.released = True
    model.offload = streamed
    streamed.table = table
    model.embed_rows = table
    return streamed


def _account(streamed: StreamedLayers, head_share: int, packed_copy: bool) -> None:
    """Set what the weights hold (held_bytes); a warning when that is above the budget (a budget
    below what streaming needs: its buffers, and the head's when it streams)."""
    buffers = sum(int(b.numel()) for b in streamed.buffers) * (2 if packed_copy else 1)  # + packed copies
    streamed.held_bytes = streamed.resident_bytes + head_share + buffers
    if streamed.held_bytes > streamed.budget_bytes:
        log.warning(
            "--resident-gb %.3f is below what streaming needs (the stream buffers%s): the weights hold "
            "%.3f GB",
            streamed.budget_bytes / 1e9,
            " and the head's" if streamed.head is not None else "",
            streamed.held_bytes / 1e9,
        )


def buffers_needed(layout: Layout, packed_copy: bool) -> Callable[[int], int]:
    """The bytes the layers' stream buffers take when `left` bytes are left for the layers, as
    plan_resident sizes them (each with its packed copy: `packed_copy`)."""
    extra = layout.max_span if packed_copy else 0
    return lambda left: plan_resident(layout, left, extra)[1]


def _float_head(
    model: Any, gemm: Any, entry: Path, budget: int, need: Callable[[int], int], checked: bool,
    direct: bool, progress: bool,
) -> tuple[Any, int, Any]:  # fmt: skip
    """The head as the streamed model runs it, the budget left for the layers, and the head's file
    when the head streams (offload_head.StreamedRows, made once the layers' stream exists).

    A head of its own on oneDNN is read from the cache file a chunk at a time (offload_head): packed
    into memory when it fits the budget together with the layers' stream buffers (`need(left)`: what
    they take when `left` bytes are left for the layers), which it then takes first (it is read every
    forward, like a layer), else streamed every forward, its buffers taken from the budget. A tied
    head is the token table, which the token lookup needs anyway: packed from memory, outside the
    budget."""
    from shared.model import offload_head

    own = model.lm_head is not model.embed and model.device.type == "cpu"
    source = offload_head.open_head(entry, checked, direct, progress) if own else None
    if source is None:
        head = gemm.pack_rows(model.lm_head)
        if gemm.kind == "onednn" and model.lm_head is not model.embed:  # one copy, as prepare(release)
            model.lm_head.data = model.lm_head.data.new_empty(0)
        return head, budget, None
    model.lm_head.data = model.lm_head.data.new_empty(0)  # (never read: target._streamed_skip)
    if gemm.kind != "onednn":  # the whole matrix, as the resident model runs it
        weight = torch.cat([source.read(c, source.buffer()).clone() for c in range(source.count)])
        source.close()
        return gemm.pack_rows(weight), budget, None
    if source.nbytes + need(budget - source.nbytes) <= budget:
        head = offload_head.resident_head(source, gemm.pack)
        source.close()
        return head, budget - source.nbytes, None
    return None, max(0, budget - source.stream_bytes), source


# ---------------------------------------------------------------------------------------------
# What the process holds


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


__all__ = [
    "OFFLOAD_MODES",
    "LayerSpan",
    "Layout",
    "OffloadError",
    "Slot",
    "StreamStats",
    "StreamedLayers",
    "TableRows",
    "attach",
    "buffers_needed",
    "check_span",
    "float_layout",
    "gguf_layout",
    "materialize",
    "peak_rss_bytes",
    "plan_resident",
    "rss_bytes",
    "stream",
    "table_on_disk",
    "verify_all",
    "with_checksums",
]
