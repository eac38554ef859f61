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
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared.model.disk_io import (
    _DTYPE_BYTES,
    ALIGN,
    CHECK_BYTES,
    CHECKSUM_FORMAT,
    HASH,
    DiskReader,
    OffloadError,
    StreamStats,
    _digest,
    _save_sidecar,
    _view,
    aligned_buffer,
    first_bad_chunk,
)
from shared.model.quantized import QuantMatrix, QuantPart
from treespec_kernels import quant_matmul as qm

log = logging.getLogger("shared.model.offload")

OFFLOAD_MODES = ("disk", "host")


@dataclass(frozen=True)
class Slot:
    """One tensor of a layer's span: projection `proj` (0 q|k|v, 1 o, 2 gate|up, 3 down), part
    `order` within it, at `offset` bytes from the span's start.

    kind: "float" (a float32/bf16/fp16 [rows, cols] array) or a GGUF block type name (rows of
    blocks); `permute_heads` > 0 undoes llama.cpp's q/k row interleave for that many heads."""

    proj: int
    order: int
    kind: str
    rows: int
    cols: int
    offset: int
    nbytes: int
    dtype: str = "float32"
    permute_heads: int = 0
    digests: tuple[int, ...] = ()  # float: its CHECK_BYTES chunks' checksums, from the cache entry


@dataclass(frozen=True)
class LayerSpan:
    index: int
    offset: int  # in the file, a multiple of ALIGN
    nbytes: int  # a multiple of ALIGN (may run past the file's end by less than ALIGN)
    slots: tuple[Slot, ...]
    digest: int = 0  # GGUF: of the span's bytes (HASH), 0 until with_checksums (float: per slot)


@dataclass(frozen=True)
class Layout:
    path: Path
    kind: str  # "float" or "gguf"
    file_bytes: int
    layers: tuple[LayerSpan, ...]
    checked: bool = False  # float: every byte was checked against the entry's checksums at load

    @property
    def max_span(self) -> int:
        return max(s.nbytes for s in self.layers)

    @property
    def layer_bytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


def _align_down(n: int) -> int:
    return n // ALIGN * ALIGN


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _span(index: int, tensors: Sequence[tuple[int, int, Slot]]) -> LayerSpan:
    """A layer's span from its tensors' (absolute offset, bytes, slot with offset 0)."""
    start = _align_down(min(o for o, _, _ in tensors))
    end = _align_up(max(o + n for o, n, _ in tensors))
    slots = tuple(Slot(**{**s.__dict__, "offset": o - start, "nbytes": n}) for o, n, s in tensors)
    return LayerSpan(index, start, end - start, slots)


_FLOAT_PROJ = {"qkv": 0, "o": 1, "gate_up": 2, "down": 3}


def float_layout(entry: Path, checked: bool = False) -> Layout:
    """The layout of a float-weight cache entry (its header.json and weights.bin), each projection
    with its checksums from the header. `checked`: weight_cache.load has just checked every byte
    of the file, which the start then reads no second time."""
    try:
        header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
        data = entry / "weights.bin"
        size = data.stat().st_size
    except (OSError, ValueError) as exc:
        raise OffloadError(f"cannot read the float-weight cache entry {entry}: {exc}") from exc
    if (header.get("hash"), header.get("chunk_bytes")) != (HASH, CHECK_BYTES):
        raise OffloadError(
            f"{entry} carries no {HASH} checksums of {CHECK_BYTES}-byte chunks (an older entry, or one "
            "made with another checksum): delete it and start again to rebuild it"
        )
    if size != header.get("data_bytes"):
        raise OffloadError(
            f"{data} is {size} bytes, its header says {header.get('data_bytes')}: truncated or replaced; "
            "delete the entry and start again to rebuild it"
        )
    per_layer: dict[int, list[tuple[int, int, Slot]]] = {}
    for p in header["params"]:
        parts = p["name"].split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in _FLOAT_PROJ:
            continue
        rows, cols = (int(n) for n in p["shape"])
        nbytes = rows * cols * _DTYPE_BYTES[p["dtype"]]
        digests = tuple(int(d) for d in p.get("digests", ()))  # (none: every read of it fails)
        slot = Slot(_FLOAT_PROJ[parts[2]], 0, "float", rows, cols, 0, nbytes, p["dtype"], 0, digests)
        per_layer.setdefault(int(parts[1]), []).append((int(p["offset"]), nbytes, slot))
    layers = tuple(_span(i, per_layer[i]) for i in sorted(per_layer))
    _check_layers(layers, data)
    return Layout(data, "float", size, layers, checked)


def gguf_layout(path: Path, reader: Any, num_layers: int, num_heads: int, num_kv_heads: int) -> Layout:
    """The layout of a GGUF's projection blocks (every projection of a type the kernels read)."""
    from shared.model.archs import by_name
    from shared.model.gguf_loader import _LAYER_NAME, _PROJECTIONS, field, hf_name

    arch = by_name(str(field(reader, "general.architecture")))
    per_layer: dict[int, list[tuple[int, int, Slot]]] = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        hit = _LAYER_NAME.fullmatch(name) if name else None
        if name is None or hit is None or hit.group(2) not in _PROJECTIONS:
            continue
        kind = t.tensor_type.name
        if kind not in qm.QTYPES:
            raise ValueError(f"{t.name} is {kind}: streamed blocks need one of {sorted(qm.QTYPES)}")
        rows, cols = (int(n) for n in reversed(t.shape.tolist()))
        proj, order = _PROJECTIONS[hit.group(2)]
        heads = 0
        if arch.gguf_qk_permuted and hit.group(2).split(".")[1] in ("q_proj", "k_proj"):
            heads = num_heads if "q_proj" in name else num_kv_heads
        slot = Slot(proj, order, kind, rows, cols, 0, int(t.n_bytes), "uint8", heads)
        per_layer.setdefault(int(hit.group(1)), []).append((int(t.data_offset), int(t.n_bytes), slot))
    if sorted(per_layer) != list(range(num_layers)):
        raise OffloadError(
            f"{path}: projection tensors for layers {sorted(per_layer)}, expected {num_layers}"
        )
    layers = tuple(_span(i, per_layer[i]) for i in range(num_layers))
    _check_layers(layers, path)
    return Layout(path, "gguf", path.stat().st_size, layers)


def _check_layers(layers: Sequence[LayerSpan], path: Path) -> None:
    size = path.stat().st_size
    for s in layers:
        need = max(sl.offset + sl.nbytes for sl in s.slots)
        if s.offset + need > size:
            raise OffloadError(
                f"{path} ends at byte {size}, but layer {s.index}'s weights run to {s.offset + need}: "
                "the file is truncated; fetch or rebuild it"
            )


# ---------------------------------------------------------------------------------------------------
# Checksums


def _checksum_path(layout: Layout) -> Path:
    from shared import model_store

    return model_store.cache_dir() / "offload" / f"{model_store.content_id(layout.path)}.checksums.json"


def with_checksums(
    layout: Layout, reader: DiskReader, progress: bool = False, sidecar: Path | None = None
) -> Layout:
    """`layout` with every span's checksum (HASH), every span checked against it once here (a file
    damaged since is refused) unless `layout.checked`. A float-weight cache entry's come with it;
    a GGUF's are read from the sidecar when one matches, else computed by reading the spans once
    (and saved). Spans are checked against these on every later read."""
    if layout.kind == "float":
        if not layout.checked:
            verify_all(layout, reader, progress)
        return layout
    path = sidecar or _checksum_path(layout)
    want = {
        "format": CHECKSUM_FORMAT,
        "hash": HASH,
        "file_bytes": layout.file_bytes,
        "spans": [[s.offset, s.nbytes] for s in layout.layers],
    }
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if {k: saved.get(k) for k in want} == want and len(saved.get("digests", [])) == len(layout.layers):
            checked = _set_digests(layout, saved["digests"])
            verify_all(checked, reader, progress)
            return checked
    except (OSError, ValueError):
        pass
    from tqdm import tqdm

    buf = aligned_buffer(layout.max_span)
    digests = []
    for s in tqdm(layout.layers, desc="checksumming streamed layers", unit="layer", disable=not progress):
        got = reader.read(buf, s.offset, s.nbytes)
        if got < s.nbytes - ALIGN:
            raise OffloadError(f"{layout.path}: layer {s.index} is truncated ({got} of {s.nbytes} bytes)")
        digests.append(_digest(_view(buf[: s.nbytes])[: min(got, s.nbytes)]))
    _save_sidecar(path, {**want, "digests": digests}, "the streamed layers' checksums")
    return _set_digests(layout, digests)


def verify_all(layout: Layout, reader: DiskReader, progress: bool = False) -> None:
    """Read every span once and check its checksum: a corrupt file is refused at start, naming the
    layer (OffloadError)."""
    from tqdm import tqdm

    buf = aligned_buffer(layout.max_span)
    for s in tqdm(layout.layers, desc="checking streamed layers", unit="layer", disable=not progress):
        got = reader.read(buf, s.offset, s.nbytes)
        check_span(layout, s, buf, got)


def check_span(layout: Layout, span: LayerSpan, buf: torch.Tensor, got: int) -> None:
    """OffloadError when `got` bytes read into `buf` are short of the span or fail its checksum."""
    if got < span.nbytes - ALIGN:
        raise OffloadError(
            f"{layout.path}: layer {span.index} read {got} of {span.nbytes} bytes: the file is truncated; "
            "fetch or rebuild it"
        )
    if span.slots and span.slots[0].digests:
        _check_slots(layout, span, buf, got)
        return
    digest = _digest(_view(buf[: span.nbytes])[: min(got, span.nbytes)])
    if digest != span.digest:
        raise OffloadError(
            f"{layout.path}: layer {span.index}'s weights fail their checksum ({HASH} {digest:x}, "
            f"expected {span.digest:x}): the file is corrupt; fetch or rebuild it"
        )


def _check_slots(layout: Layout, span: LayerSpan, buf: torch.Tensor, got: int) -> None:
    """check_span for a float span: each projection against its chunks' checksums."""
    for sl in span.slots:
        if got < sl.offset + sl.nbytes:
            raise OffloadError(f"{layout.path}: layer {span.index} read {got} of {sl.offset + sl.nbytes} "
                               "bytes: the file is truncated; start again to rebuild it")  # fmt: skip
        bad = first_bad_chunk(_view(buf[sl.offset : sl.offset + sl.nbytes]), sl.digests)
        if bad is not None:
            at = span.offset + sl.offset + bad * CHECK_BYTES
            raise OffloadError(
                f"{layout.path}: layer {span.index}'s weights fail their checksum ({HASH}, the chunk at "
                f"byte {at}): the file is corrupt; start again to rebuild it"
            )


def _set_digests(layout: Layout, digests: Sequence[int]) -> Layout:
    spans = tuple(
        LayerSpan(s.index, s.offset, s.nbytes, s.slots, int(c))
        for s, c in zip(layout.layers, digests, strict=True)
    )
    return Layout(layout.path, layout.kind, layout.file_bytes, spans)


# ---------------------------------------------------------------------------------------------------
# From bytes to the forward's weights


def _unpermute(blocks: torch.Tensor, heads: int) -> torch.Tensor:
    rows = blocks.shape[0]
    return (
        blocks.reshape(heads, rows // heads // 2, 2, blocks.shape[1]).transpose(1, 2).reshape(blocks.shape)
    ).contiguous()


def materialize(span: LayerSpan, buf: torch.Tensor, pack: Callable[[torch.Tensor], Any]) -> tuple[Any, ...]:
    """The layer's (qkv, o, gate_up, down) from its bytes `buf` (the span read from offset 0).
    Float slots are views packed by `pack` (a copy for oneDNN); block slots are QuantMatrix views
    of `buf`, which must then outlive the weights."""
    by_proj: dict[int, list[Slot]] = {}
    for s in span.slots:
        by_proj.setdefault(s.proj, []).append(s)
    out: list[Any] = []
    for proj in range(4):
        slots = sorted(by_proj[proj], key=lambda s: s.order)
        if slots[0].kind == "float":
            (s,) = slots
            dt = getattr(torch, s.dtype)
            w = buf[s.offset : s.offset + s.nbytes].view(dt).view(s.rows, s.cols)
            out.append(pack(w))
            continue
        parts = []
        for s in slots:
            q = qm.qtype(s.kind)
            blocks = buf[s.offset : s.offset + s.nbytes].view(s.rows, qm.row_bytes(q, s.cols))
            if s.permute_heads:
                blocks = _unpermute(blocks, s.permute_heads)
            parts.append(QuantPart(q, blocks))
        out.append(QuantMatrix(parts, slots[0].cols))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------
# The streamed layers


@dataclass
class _Job:
    layer: int
    buffer: int
    future: Future[tuple[Any, ...]]


@dataclass
class StreamedLayers:
    """A sequence of per-layer projection weights for `LlamaModel.forward_packed`, some resident,
    the others streamed into two buffers with read-ahead. Iterate once per forward."""

    layout: Layout
    resident: dict[int, tuple[Any, ...]]
    # read + check + materialize on the reader thread: (span, buffer, event the buffer's last reader
    # recorded on a GPU's compute stream, or None)
    load: Callable[[LayerSpan, torch.Tensor, Any], tuple[Any, ...]]
    buffers: list[torch.Tensor]
    mode: str
    resident_bytes: int
    budget_bytes: int
    stats: StreamStats = field(default_factory=StreamStats)
    closer: Callable[[], None] | None = None
    read_threads: int = 1
    table: TableRows | None = None  # the token table left on disk (float weights on the CPU)
    head: Any = None  # the head when it streams too (offload_head.StreamedRows)
    # what the weights hold: resident layers, stream buffers and a head of its own (held or its
    # stream's buffers); above budget_bytes only when the budget is below what streaming needs
    held_bytes: int = 0
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="offload")
    )
    _jobs: list[_Job] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _released: dict[int, Any] = field(default_factory=dict)  # buffer -> CUDA event after its last use

    def __len__(self) -> int:
        return len(self.layout.layers)

    @property
    def streamed(self) -> list[int]:
        return [s.index for s in self.layout.layers if s.index not in self.resident]

    def _timed_load(self, span: LayerSpan, buf: torch.Tensor, after: Any) -> tuple[Any, ...]:
        t0 = time.perf_counter()
        out = self.load(span, buf, after)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.read_s += dt
            self.stats.bytes_read += span.nbytes
            self.stats.layers_streamed += 1
        return out

    def _submit(self, layer: int, buffer: int) -> _Job:
        span = self.layout.layers[layer]
        after = self._released.pop(buffer, None)
        job = _Job(layer, buffer, self._pool.submit(self._timed_load, span, self.buffers[buffer], after))
        self._jobs.append(job)
        return job

    def _take(self, layer: int) -> _Job:
        """The job reading `layer`; jobs for other layers (a forward that stopped midway) are drained."""
        job = self._drain(until=layer)
        if job is not None:
            return job
        busy = {j.buffer for j in self._jobs}
        return self._submit(layer, next(b for b in range(len(self.buffers)) if b not in busy))

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        streamed = self.streamed
        nxt = dict(itertools.pairwise(streamed))
        t_start = time.perf_counter()
        self.stats.forwards += 1
        last = 0
        gpu = bool(self.buffers) and self.buffers[0].device.type == "cuda"
        for i in range(len(self)):
            if i in self.resident:
                yield self.resident[i]
                continue
            job = self._take(i)
            if i in nxt:  # read the next streamed layer into the other buffer while this one computes
                self._submit(nxt[i], 1 - job.buffer)
            t0 = time.perf_counter()
            try:
                weights = job.future.result()
            finally:
                self.stats.wait_s += time.perf_counter() - t0
            yield weights
            last = job.buffer
            if gpu:  # the buffer may be overwritten once the kernels queued so far have read it
                self._released[job.buffer] = torch.cuda.current_stream(self.buffers[0].device).record_event()
        self.stats.forward_s += time.perf_counter() - t_start
        if streamed:  # the next forward starts with the first streamed layer: read it ahead now
            self._drain()
            self._submit(streamed[0], 1 - last)

    def _drain(self, until: int | None = None) -> _Job | None:
        """Wait out pending jobs in order, up to the one reading layer `until` (returned, not waited)."""
        for job in list(self._jobs):
            self._jobs.remove(job)
            if job.layer == until:
                return job
            try:
                job.future.result()
            except Exception:
                pass
        return None

    def describe(self) -> str:
        """What a forward's cost depends on: mode, file, layers resident of all, reader threads."""
        return (
            f"offload={self.mode}:{self.layout.kind}:{self.layout.path.name}:"
            f"{len(self.resident)}/{len(self)}:threads={self.read_threads}"
        )

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = StreamStats()

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)
        if self.closer is not None:
            self.closer()
        if self.table is not None:
            self.table.close()
        if self.head is not None:
            self.head.close()


def plan_resident(layout: Layout, budget_bytes: int, extra_per_buffer: int = 0) -> tuple[set[int], int]:
    """Which layers stay resident within `budget_bytes` (first ones first), and the bytes the two
    stream buffers take (0 when everything fits). The buffers (each the largest span, plus
    `extra_per_buffer` for a packed copy in flight) come out of the budget."""
    total = layout.layer_bytes
    if budget_bytes >= total:
        return {s.index for s in layout.layers}, 0
    buffers = 2 * (layout.max_span + extra_per_buffer)
    left = budget_bytes - buffers
    keep: set[int] = set()
    for s in layout.layers:
        if s.nbytes > left:
            break
        keep.add(s.index)
        left -= s.nbytes
    return keep, buffers


def stream(
    layout: Layout,
    budget_bytes: int,
    pack: Callable[[torch.Tensor], Any],
    mode: str = "disk",
    device: torch.device | None = None,
    read_threads: int = 2,
    verify: bool = True,
    progress: bool = False,
    delay_s: float = 0.0,
    direct: bool = True,
    packed_copy: bool = False,
    sidecar: Path | None = None,
) -> StreamedLayers:
    """StreamedLayers over `layout` within `budget_bytes` of layers (see plan_resident).

    mode "disk": O_DIRECT reads (`direct`); "host": every streamed span read once into host memory
    (pinned when `device` is a GPU) and copied in per forward. `packed_copy`: `pack` makes a copy
    the size of the float span (oneDNN), budgeted per buffer. `verify`: the checksum on every read."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"offload mode must be one of {OFFLOAD_MODES}, got {mode!r}")
    dev = device or torch.device("cpu")
    reader = DiskReader(layout.path, read_threads, direct=direct, delay_s=delay_s if mode == "disk" else 0.0)
    if verify:
        layout = with_checksums(layout, reader, progress, sidecar)
    keep, _ = plan_resident(layout, budget_bytes, layout.max_span if packed_copy else 0)
    loader = _Loader(layout, reader, pack, verify, dev)
    from tqdm import tqdm

    resident: dict[int, tuple[Any, ...]] = {}
    streamed = [s for s in layout.layers if s.index not in keep]
    for s in tqdm(layout.layers, desc="loading layers", unit="layer", disable=not progress):
        if s.index in keep:
            resident[s.index] = loader.read_disk(s, aligned_buffer(s.nbytes, dev))
    if mode == "host":
        loader.hold(streamed)
    buffers = [aligned_buffer(layout.max_span, dev) for _ in range(2)] if streamed else []
    return StreamedLayers(
        layout,
        resident,
        loader.read_host if mode == "host" else loader.read_disk,
        buffers,
        mode,
        sum(layout.layers[i].nbytes for i in keep),
        budget_bytes,
        closer=reader.close,
        read_threads=reader.threads,
    )


class _Loader:
    """Reads a layer's span into a buffer, checks it and materializes its weights (on the reader
    thread): from disk (through a host staging buffer for a GPU) or from spans held in host memory
    (`hold`; pinned and copied on a side CUDA stream on a GPU)."""

    def __init__(
        self,
        layout: Layout,
        reader: DiskReader,
        pack: Callable[[torch.Tensor], Any],
        verify: bool,
        device: torch.device,
    ) -> None:
        self.layout, self.reader, self.pack, self.verify = layout, reader, pack, verify
        self.device = device
        self.staging = aligned_buffer(layout.max_span) if device.type != "cpu" else None
        self.host_spans: dict[int, torch.Tensor] = {}
        self.copy_stream: Any = None

    def check(self, span: LayerSpan, buf: torch.Tensor, got: int) -> None:
        if self.verify:
            check_span(self.layout, span, buf, got)
        elif got < span.nbytes - ALIGN:
            raise OffloadError(
                f"{self.layout.path}: layer {span.index} read {got} of {span.nbytes} bytes (truncated)"
            )

    def read_disk(self, span: LayerSpan, buf: torch.Tensor, after: Any = None) -> tuple[Any, ...]:
        host = buf if buf.device.type == "cpu" else self.staging
        assert host is not None
        got = self.reader.read(host, span.offset, span.nbytes)
        self.check(span, host, got)
        if host is not buf:
            if after is not None:
                after.synchronize()
            buf[: span.nbytes].copy_(host[: span.nbytes])
        return materialize(span, buf, self.pack)

    def hold(self, spans: Sequence[LayerSpan]) -> None:
        """Read `spans` once into host memory (pinned for a GPU), checked, for read_host."""
        pin = self.device.type == "cuda"
        for s in spans:
            h = aligned_buffer(s.nbytes, None, pin=pin)
            self.check(s, h, self.reader.read(h, s.offset, s.nbytes))
            self.host_spans[s.index] = h
        if pin:
            self.copy_stream = torch.cuda.Stream(self.device)

    def read_host(self, span: LayerSpan, buf: torch.Tensor, after: Any = None) -> tuple[Any, ...]:
        src, stream = self.host_spans[span.index], self.copy_stream
        if stream is not None:
            with torch.cuda.stream(stream):
                if after is not None:  # the compute stream's last reader of this buffer first
                    stream.wait_event(after)
                buf[: span.nbytes].copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()  # the reader thread waits; the compute stream never blocks on it
        else:
            buf[: span.nbytes].copy_(src)
        return materialize(span, buf, self.pack)


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
# The token table, left on disk


class TableRows:
    """A float token table left in the float-weight cache file: a forward reads the rows of its
    tokens (6 KB each for the 1.5B; the page cache keeps the frequent ones, outside this process's
    memory) instead of holding the table (0.93 GB for the 1.5B in fp32). The rows are read and
    checked in the entry's CHECK_BYTES chunks against the checksums the entry was written with
    (`digests`): every chunk a forward reads is checked, so a damaged table is an error naming the
    rows, never a wrong token. At start every chunk is checked once, unless weight_cache.load has
    just done so (`checked`)."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], dtype: torch.dtype,
                 digests: Sequence[int], checked: bool = False, progress: bool = False) -> None:  # fmt: skip
        from tqdm import tqdm

        self.path, self.offset, self.shape, self.dtype = path, offset, shape, dtype
        self.row_bytes = shape[1] * torch.empty(0, dtype=dtype).element_size()
        self.nbytes = shape[0] * self.row_bytes
        if len(digests) != -(-self.nbytes // CHECK_BYTES):
            raise OffloadError(f"{path}: the token table has {len(digests)} checksums; rebuild the entry")
        self.digests = [int(d) for d in digests]
        self.fd = os.open(path, os.O_RDONLY)
        if not checked:  # a table damaged since the entry was made is refused at start
            try:
                for c in tqdm(
                    range(len(self.digests)), desc="checking the token table", disable=not progress
                ):
                    self._checked(c)
            except OffloadError:
                self.close()
                raise

    def _checked(self, c: int) -> bytes:
        """Chunk c's bytes, read and checked."""
        at = c * CHECK_BYTES
        n = min(CHECK_BYTES, self.nbytes - at)
        data = os.pread(self.fd, n, self.offset + at)
        rows = f"rows {at // self.row_bytes}..{(at + n - 1) // self.row_bytes}"
        if len(data) != n:
            raise OffloadError(
                f"{self.path}: the token table is truncated ({rows}); start again to rebuild it"
            )
        if _digest(memoryview(data)) != self.digests[c]:
            raise OffloadError(f"{self.path}: the token table's {rows} fail their checksum: the file is "
                               "corrupt; start again to rebuild it")  # fmt: skip
        return data

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> [T, hidden]: the table's rows, read and checked."""
        ids = tokens.reshape(-1).tolist()
        out = torch.empty(len(ids), self.shape[1], dtype=self.dtype)
        chunks: dict[int, bytes] = {}
        for i, t in enumerate(ids):
            if not 0 <= t < self.shape[0]:
                raise IndexError(f"token {t} is outside the table of {self.shape[0]} rows")
            start, end = t * self.row_bytes, (t + 1) * self.row_bytes
            first, last = start // CHECK_BYTES, (end - 1) // CHECK_BYTES  # a row may span two chunks
            for c in range(first, last + 1):
                if c not in chunks:
                    chunks[c] = self._checked(c)
            raw = chunks[first] if first == last else b"".join(chunks[c] for c in range(first, last + 1))
            skip = start - first * CHECK_BYTES
            out[i] = torch.frombuffer(bytearray(raw[skip : skip + self.row_bytes]), dtype=self.dtype)
        return out.to(tokens.device)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def table_on_disk(model: Any, head: Any, entry: Path, checked: bool, progress: bool) -> TableRows | None:
    """Leave the float token table of `model` in its cache entry (TableRows) and free it, where
    nothing else uses it (`head`, the head as the model will run it, is a packed copy or another
    matrix); None otherwise. `checked`: as float_layout's."""
    if model.weights == "quantized" or head is model.embed or model.device.type != "cpu":
        return None
    header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
    spec = next((p for p in header["params"] if p["name"] == "embed"), None)
    shape = [model.config.vocab_size, model.config.hidden_size]
    if spec is None or spec["dtype"] not in _DTYPE_BYTES or spec["shape"] != shape:
        if model.embed.numel() == 0:
            raise OffloadError(f"{entry}: no token table of shape {shape} to read rows from; rebuild it")
        return None
    dtype = getattr(torch, spec["dtype"])
    table = TableRows(
        entry / "weights.bin",
        int(spec["offset"]),
        (shape[0], shape[1]),
        dtype,
        spec["digests"],
        checked,
        progress,
    )
    model.embed.data = model.embed.data.new_empty(0)
    return table


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
    "Layout",
    "OffloadError",
    "StreamStats",
    "StreamedLayers",
    "attach",
    "float_layout",
    "gguf_layout",
    "peak_rss_bytes",
    "plan_resident",
    "rss_bytes",
    "stream",
]
