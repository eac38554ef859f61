"""Streamed float weights (shared/model/offload.py, `serve --offload disk|host --resident-gb N`):
logits bit-identical to resident weights from the float-weight cache (on the CPU and on a GPU), the
token table kept on disk, a head untied or of its own held within the budget or streamed, a
corrupt head or stream file refused or rebuilt (never a wrong token). The GGUF's blocks are
test_offload_gguf.py's, the service's use test_offload_service.py's."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from shared.model import (
    LlamaModel,
    build_model,
    load_target,
    make_tiny_config,
    offload,
    weight_cache,
)
from shared.model.llama import DecoderLayer, choose_gemm
from tests.cloud_verifier.checkpoints import config_for, small_vocab, write_gguf
from tests.cloud_verifier.offload_helpers import CPU, LAYERS, _entry, _logits, _streamed, _tiny_model, _tokens
from tests.cloud_verifier.test_tree_forward import check_round


def _flip_byte(path: Path, at: int, mask: int) -> None:
    """XOR one byte of a file in place (a damaged weight)."""
    with path.open("r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ mask]))


def test_streamed_float_layers_give_the_resident_logits_bit_for_bit(tmp_path: Path) -> None:
    resident = _tiny_model()
    entry = _entry(tmp_path, resident)
    want = _logits(resident, _tokens())
    for mode in offload.OFFLOAD_MODES:
        model, st = _streamed(entry, tmp_path, 1, mode=mode)
        assert sorted(st.resident) == [0] and st.streamed == list(range(1, LAYERS))
        got = _logits(model, _tokens())
        assert torch.equal(got, want), mode
        assert st.stats.forwards == 1 and st.stats.layers_streamed >= LAYERS - 1
        assert st.stats.bytes_read >= (LAYERS - 1) * st.layout.layers[1].nbytes
        # the model's own float projections are gone: the streamed copies are the only ones
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            assert all(p.numel() == 0 for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        st.close()


def test_the_float_token_table_stays_on_disk_checked(tmp_path: Path) -> None:
    """Streaming float weights on the CPU leaves the token table in the cache file: the model holds
    none of it (the head is its own packed copy), a forward reads its tokens' rows, and the logits
    are the resident model's bit for bit. A damaged row is an error naming the table's rows, while
    serving and at the next start; repaired, the same logits again."""
    resident = _tiny_model()
    entry = _entry(tmp_path, resident)
    want = _logits(resident, _tokens())
    model, st = _streamed(entry, tmp_path, 1)
    if st.table is None:
        pytest.skip("this CPU's projection kernel uses the token table as the head itself")
    assert model.embed.numel() == 0
    assert torch.equal(_logits(model, _tokens()), want)
    table = st.table
    token = _tokens()[5]
    at = table.offset + token * table.row_bytes + 8
    data = entry / "weights.bin"

    def flip() -> None:
        _flip_byte(data, at, 0x10)

    flip()
    with pytest.raises(offload.OffloadError, match="token table's rows"):
        _logits(model, _tokens())
    st.close()
    with pytest.raises(offload.OffloadError, match=r"token table's rows.*corrupt"):
        _streamed(entry, tmp_path, 1)
    flip()
    model, st = _streamed(entry, tmp_path, 1)
    assert torch.equal(_logits(model, _tokens()), want)
    st.close()


def _untied(tmp: Path) -> tuple[LlamaModel, Path]:
    """A tiny model whose head is its own matrix (as the 1.5B's GGUF), and its cache entry."""
    resident = build_model(make_tiny_config(num_layers=LAYERS, tie_embeddings=False), 5, "float32", "cpu")
    assert resident.lm_head is not resident.embed
    return resident, _entry(tmp, resident)


def _streamed_start(entry: Path, budget: int, sidecar: Path) -> tuple[LlamaModel, offload.StreamedLayers]:
    """A streamed start as load_target makes it: read what target._streamed_skip keeps, then attach."""
    from shared.model.target import _streamed_skip

    hit = weight_cache.load(entry, torch.float32, torch.device("cpu"), False, skip=_streamed_skip(entry, CPU))
    assert hit is not None
    model = hit[0]
    layout = offload.float_layout(entry, checked=True)  # (the load has just checked every byte)
    return model, offload.attach(model, layout, budget / 1e9, sidecar=sidecar)


def _onednn_only() -> None:
    if choose_gemm("auto", CPU, torch.float32) != "onednn":
        pytest.skip("this CPU has no oneDNN projections: the head is packed from memory as before")


def test_an_untied_head_streams_with_the_table_never_read(tmp_path: Path) -> None:
    """A model whose head is its own matrix (the 1.5B's GGUF): a streamed start reads neither the
    projections, nor the token table, nor the head (target._streamed_skip), so its peak memory holds
    none of them; the rows and the head come from the file and the logits are the resident model's
    bit for bit."""
    from shared.model.target import _streamed_skip

    resident, entry = _untied(tmp_path)
    want = _logits(resident, _tokens())
    skip = _streamed_skip(entry, CPU)
    assert skip("embed") and skip("lm_head") and skip("layers.0.qkv") and not skip("norm")
    layout = offload.float_layout(entry)
    model, st = _streamed_start(entry, 2 * layout.max_span, tmp_path / "c.json")
    assert model.embed.numel() == 0 and model.lm_head.numel() == 0  # never read
    assert st.table is not None
    assert torch.equal(_logits(model, _tokens()), want)
    st.close()


def test_a_head_of_its_own_is_held_within_the_budget_else_streamed_bit_for_bit(tmp_path: Path) -> None:
    """The head counts in the resident budget: packed into memory a chunk at a time when it fits
    (its chunks, HEAD_CHUNK_ROWS rows each, as a resident model's), else streamed every forward with
    read-ahead (offload_head.StreamedRows), its buffers within the budget. Either way the logits are
    the resident model's bit for bit, forward after forward, and a tree's rows equal decoding its
    path one token at a time."""
    from shared.model.llama import HEAD_CHUNK_ROWS, RowChunks
    from shared.model.offload_head import StreamedRows

    _onednn_only()
    resident, entry = _untied(tmp_path)
    want = _logits(resident, _tokens())
    c = resident.config
    head_bytes = c.vocab_size * c.hidden_size * 4
    chunks = -(-c.vocab_size // HEAD_CHUNK_ROWS)
    assert chunks > 1  # the tiny vocabulary already spans several chunks
    assert isinstance(resident.prepare().lm_head, RowChunks)
    span = offload.float_layout(entry).max_span
    model, st = _streamed_start(entry, head_bytes + 4 * span, tmp_path / "c.json")
    head = model.prepare().lm_head
    assert isinstance(head, RowChunks) and not isinstance(head, StreamedRows) and len(head.parts) == chunks
    assert not st.resident and abs(st.budget_bytes - head_bytes - 4 * span) <= 1  # the head came first
    assert st.held_bytes <= st.budget_bytes
    assert torch.equal(_logits(model, _tokens()), want)
    st.close()
    # a byte short of the head and the layers' stream buffers: holding the head would overrun the
    # budget, so it streams and the budget holds
    model, st = _streamed_start(entry, head_bytes + 4 * span - 1, tmp_path / "c.json")
    head = model.prepare().lm_head
    assert isinstance(head, StreamedRows) and st.held_bytes <= st.budget_bytes
    # the layers held (here all of them: the head's stream takes less than the head), the layers'
    # buffers with their packed copies (none then), and the head's stream
    buffers = 2 * sum(int(b.numel()) for b in st.buffers)
    assert st.held_bytes == st.resident_bytes + buffers + head.buffer_bytes
    assert torch.equal(_logits(model, _tokens()), want)
    st.close()
    model, st = _streamed_start(entry, 4 * span + head_bytes * 3 // 4, tmp_path / "c.json")
    head = model.prepare().lm_head
    assert isinstance(head, StreamedRows)
    assert sum(int(b.numel()) for b in st.buffers) + st.resident_bytes + head.buffer_bytes <= st.budget_bytes
    for _ in range(3):
        read = st.stats.bytes_read
        assert torch.equal(_logits(model, _tokens()), want)
        assert st.stats.bytes_read - read >= head_bytes  # the whole head, every forward
    rng = random.Random(77)
    check_round(model, rng, prompt_len=20, nodes=12, tail=2, cond=1, exact=True)
    st.close()


def test_a_corrupt_head_is_refused_and_never_gives_a_wrong_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A flipped byte in a streamed head: the next forward that reads its chunk fails naming the
    head's rows; at the next start the load finds it (and the entry is rebuilt), and a stream
    attached without that load refuses the file; repaired, the same logits again."""
    from shared.model.offload_head import head_entry

    _onednn_only()
    resident, entry = _untied(tmp_path)
    span = offload.float_layout(entry).max_span
    model, st = _streamed_start(entry, 4 * span, tmp_path / "c.json")  # records the checksums
    want = _logits(model, _tokens())
    spec = head_entry(entry)
    assert spec is not None
    at = int(spec["offset"]) + 9000 * resident.config.hidden_size * 4 + 12  # in the second chunk
    data = entry / "weights.bin"

    def flip() -> None:
        _flip_byte(data, at, 0x08)

    flip()
    with pytest.raises(offload.OffloadError, match="head's rows 8192"):
        for _ in range(3):  # (a chunk read ahead before the flip may still pass once)
            _logits(model, _tokens())
    st.close()
    with caplog.at_level("WARNING", logger="shared.model.weights"):
        assert weight_cache.load(entry, torch.float32, CPU, False, skip=lambda name: True) is None
    assert "fails its checksum in lm_head" in caplog.text
    fresh = build_model(resident.config, 5, "float32", "cpu")
    with pytest.raises(offload.OffloadError, match=r"head's rows 8192.*corrupt"):
        offload.attach(fresh, offload.float_layout(entry), 4 * span / 1e9)
    flip()
    model, st = _streamed_start(entry, 4 * span, tmp_path / "c.json")
    assert torch.equal(_logits(model, _tokens()), want)
    st.close()


def test_the_checksums_come_with_the_entry_not_with_the_first_stream(tmp_path: Path) -> None:
    """Bytes changed after the entry was made and before any stream ever read it (no sidecar
    anywhere) are refused at the first start: the layers, the token table and the head are checked
    against the checksums the entry was written with, not against checksums of what is there now.
    Repaired, the resident logits."""
    resident, entry = _untied(tmp_path)
    want = _logits(resident, _tokens())
    layout = offload.float_layout(entry)
    layer = layout.layers[2]
    table_at = _offset(entry, "embed") + _tokens()[3] * resident.config.hidden_size * 4
    places = [(layer.offset + layer.slots[1].offset + 64, r"layer 2's weights.*corrupt")]
    places.append((table_at + 4, r"token table's rows.*corrupt"))
    if choose_gemm("auto", CPU, torch.float32) == "onednn":  # the head is read from the file too
        places.append((_offset(entry, "lm_head") + 100, r"head's rows 0\.\..*corrupt"))
    data = entry / "weights.bin"
    for at, says in places:
        _flip_byte(data, at, 0x20)
        fresh = build_model(resident.config, 5, "float32", "cpu")
        with pytest.raises(offload.OffloadError, match=says):
            offload.attach(fresh, offload.float_layout(entry), 0.0, sidecar=tmp_path / f"{at}.json")
        _flip_byte(data, at, 0x20)
    fresh = build_model(resident.config, 5, "float32", "cpu")
    st = offload.attach(fresh, offload.float_layout(entry), 0.0, sidecar=tmp_path / "c.json")
    assert torch.equal(_logits(fresh, _tokens()), want)
    st.close()


def _offset(entry: Path, name: str) -> int:
    """Where parameter `name` starts in the entry's weights.bin."""
    header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
    return int(next(p["offset"] for p in header["params"] if p["name"] == name))


@pytest.mark.parametrize("kind", ["llama", "llama3-untied"])
def test_a_stream_file_rewritten_between_two_starts_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """`--offload disk` from a GGUF's float-weight cache entry: weights.bin rewritten between two
    starts (same size, a new mtime, one streamed projection changed) is found by the second start,
    which says so in one line and rebuilds the entry; its output is the resident model's."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    tokens, _ = small_vocab()
    path = tmp_path / "m.gguf"
    write_gguf(path, build_model(config_for(kind, len(tokens)), 4, "float32", "cpu"))
    ids = [1, 40, 100, 7, 200, 3, 150, 9, 260]
    want = _logits(load_target(str(path), progress=False).model, ids)
    first = load_target(str(path), progress=False, offload="disk", resident_gb=0.0)
    assert first.model.offload is not None and len(first.model.offload.streamed) == first.config.num_layers
    assert torch.equal(_logits(first.model, ids), want)
    first.model.offload.close()
    data = weight_cache.entry_dir(path, torch.float32) / "weights.bin"
    raw = bytearray(data.read_bytes())
    raw[_offset(data.parent, "layers.1.down") + 303] ^= 0x01  # a weight's exponent: x4 or /4
    mtime = data.stat().st_mtime_ns
    data.write_bytes(raw)  # rewritten in place: the same size
    os.utime(data, ns=(mtime + 10**9, mtime + 10**9))
    with caplog.at_level("WARNING", logger="shared.model.weights"):
        second = load_target(str(path), progress=False, offload="disk", resident_gb=0.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "shared.model.weights"]
    assert len(lines) == 1 and "fails its checksum in layers.1.down" in lines[0] and "rebuilding" in lines[0]
    assert second.model.offload is not None
    assert torch.equal(_logits(second.model, ids), want)
    second.model.offload.close()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", offload.OFFLOAD_MODES)
def test_on_a_gpu_streamed_layers_give_the_resident_logits(tmp_path: Path, mode: str) -> None:
    """bf16 on CUDA: `host` copies pinned spans on a side stream (the compute stream never waits
    on the copy, the copy waits for the compute that last read the buffer); `disk` reads into a
    host staging buffer first. Either way the logits equal the resident model's bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    resident = build_model(make_tiny_config(num_layers=LAYERS), 3, "bfloat16", dev)
    entry = _entry(tmp_path, resident)
    model = build_model(make_tiny_config(num_layers=LAYERS), 3, "bfloat16", dev)
    layout = offload.float_layout(entry)
    st = offload.attach(model, layout, 3 * layout.max_span / 1e9, mode, sidecar=tmp_path / "checksums.json")
    assert st.buffers[0].device.type == "cuda" and len(st.streamed) == LAYERS - 1
    for n in (30, 5, 61):  # several forwards: buffers reused while earlier kernels may still run
        tokens = _tokens(n, seed=n)
        assert torch.equal(_logits(model, tokens), _logits(resident, tokens)), (mode, n)
    rng = random.Random(5)
    check_round(model, rng, prompt_len=20, nodes=12, tail=2, cond=1, tol=0.5)
    assert st.stats.layers_streamed >= 3 * (LAYERS - 1)
    st.close()
