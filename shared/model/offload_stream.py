"""Streaming a model's layers (shared/model/offload.py): `stream` keeps the layers that fit the budget
resident and reads the others' spans into two buffers for every forward, the next layer read ahead
on a background thread while the current one computes (`StreamedLayers`). Each span read is
checked (offload_integrity) and turned into the forward's weights (`materialize`): float slots
packed for the CPU's projection kernels, block slots QuantMatrix views of the buffer.

Modes: `disk` reads each streamed span with O_DIRECT (several reader threads split a span when
`read_threads` > 1); `host` keeps every streamed span in host memory (pinned on a GPU host) and
copies it into the working buffer (on a GPU, on a side CUDA stream with an event the compute
stream waits on).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shared.model.disk_io import ALIGN, DiskReader, OffloadError, StreamStats, aligned_buffer
from shared.model.offload_integrity import check_span, with_checksums
from shared.model.offload_layout import LayerSpan, Layout, Slot, plan_resident
from shared.model.quantized import QuantMatrix, QuantPart
from treespec_kernels import quant_matmul as qm

if TYPE_CHECKING:
    from shared.model.offload_table import TableRows

OFFLOAD_MODES = ("disk", "host")


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
