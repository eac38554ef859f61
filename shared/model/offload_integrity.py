"""The integrity of streamed spans (xxh3-64, or CRC-32 without xxhash): a float-weight cache entry's
spans carry the checksums of their parameters' CHECK_BYTES chunks from the entry's header; a GGUF's
are computed the first time it streams and kept in a sidecar keyed by the file's content id.
`with_checksums` checks every span once at start; `check_span` checks one on every read (the reader
thread). A short or corrupt span raises OffloadError naming the layer, never a wrong token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from shared.model.disk_io import (
    ALIGN,
    CHECK_BYTES,
    CHECKSUM_FORMAT,
    HASH,
    DiskReader,
    OffloadError,
    _digest,
    _save_sidecar,
    _view,
    aligned_buffer,
    first_bad_chunk,
)
from shared.model.offload_layout import LayerSpan, Layout


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
