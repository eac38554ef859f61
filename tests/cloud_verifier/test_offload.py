"""Streamed weights (shared/model/offload.py, `serve --offload disk|host --resident-gb N`): logits
bit-identical to resident weights (float32 from the float-weight cache, and the GGUF's blocks),
tree rows bit-identical to one-token decoding under streaming, the resident budget kept, a
truncated or corrupt file refused with the layer named (never a wrong token), a slow disk only
slower."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.model import (
    LlamaModel,
    build_model,
    disk_io,
    load_target,
    make_tiny_config,
    offload,
    prefill,
    weight_cache,
)
from shared.model.generate import greedy_generate
from shared.model.llama import DecoderLayer, choose_gemm
from shared.model.tokenizer import placeholder_tokenizer
from tests.cloud_verifier.checkpoints import config_for, small_vocab, write_gguf
from tests.cloud_verifier.service import prompt_tokens
from tests.cloud_verifier.test_quantized_model import _target, tree_generation, write_llama_gguf
from tests.cloud_verifier.test_tree_forward import check_round
from treespec_kernels import quant_matmul as qm

LAYERS = 8
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def _tiny_model(layers: int = LAYERS, seed: int = 3) -> LlamaModel:
    return build_model(make_tiny_config(num_layers=layers), seed, "float32", "cpu")


def _entry(tmp: Path, model: LlamaModel) -> Path:
    entry = tmp / "entry"
    assert weight_cache.save(entry, model, placeholder_tokenizer(), progress=False)
    return entry


def _logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    kv = model.new_kv_cache(64, 16)
    kv.add(0)
    return prefill(model, kv, 0, tokens)


def _flip_byte(path: Path, at: int, mask: int) -> None:
    """XOR one byte of a file in place (a damaged weight)."""
    with path.open("r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ mask]))


def _tokens(n: int = 30, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(make_tiny_config().vocab_size) for _ in range(n)]


def _streamed(
    entry: Path, tmp: Path, resident_layers: int, **kw: object
) -> tuple[LlamaModel, offload.StreamedLayers]:
    """The tiny model (seed 3) streaming from `entry` with `resident_layers` kept."""
    model = _tiny_model()
    layout = offload.float_layout(entry)
    # oneDNN's packed copy of a layer in flight is budgeted beside each buffer
    budget = (4 * layout.max_span + resident_layers * layout.max_span) / 1e9
    st = offload.attach(model, layout, budget, sidecar=tmp / "checksums.json", **kw)  # type: ignore[arg-type]
    return model, st


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


@pytest.mark.parametrize("seed", range(4))
def test_tree_rows_under_streaming_equal_one_token_decoding(tmp_path: Path, seed: int) -> None:
    model, st = _streamed(_entry(tmp_path, _tiny_model()), tmp_path, 2)
    rng = random.Random(900 + seed)
    check_round(
        model,
        rng,
        prompt_len=rng.randint(2, 40),
        nodes=rng.randint(1, 24),
        tail=rng.randint(1, 3),
        cond=rng.randint(0, 2),
        exact=True,
    )
    assert st.stats.forwards > 3 and st.stats.layers_streamed > 3 * (LAYERS - 2)
    overlap = st.stats.overlap()
    assert overlap is not None and 0.0 <= overlap <= 1.0


@pytest.mark.skipif(qm.load() is None, reason="quant_matmul kernel not built")
def test_gguf_blocks_stream_bit_for_bit(tmp_path: Path) -> None:
    """A `llama` GGUF of Q8_0 blocks (q/k rows permuted as llama.cpp writes them, undone per read)."""
    source = _tiny_model(layers=4, seed=5)
    path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(path, source)
    from shared.model.gguf_loader import config_from_gguf, load_gguf_quantized, open_gguf

    def load() -> LlamaModel:
        reader = open_gguf(path)
        model = build_model(config_from_gguf(reader), None, "float32", "cpu")
        load_gguf_quantized(reader, model, progress=False)
        return model

    want, got = load(), load()
    c = got.config
    layout = offload.gguf_layout(path, open_gguf(path), c.num_layers, c.num_heads, c.num_kv_heads)
    assert layout.kind == "gguf" and all(s.offset % disk_io.ALIGN == 0 for s in layout.layers)
    st = offload.attach(got, layout, 0.0, sidecar=tmp_path / "checksums.json")
    assert st.streamed == [0, 1, 2, 3] and not st.resident
    assert torch.equal(_logits(got, _tokens()), _logits(want, _tokens()))
    rng = random.Random(77)
    check_round(got, rng, prompt_len=20, nodes=12, tail=2, cond=1, exact=True)


@pytest.mark.parametrize("weights", ["fp32", "quantized"])
def test_smollm2_streams_bit_for_bit(weights: str) -> None:
    """The real loader path (`load_target(..., offload="disk")`): the float-weight cache (made on
    first use) or the GGUF's Q4_1 blocks, every layer streamed, against the resident model."""
    if weights == "quantized" and qm.load() is None:
        pytest.skip("quant_matmul kernel not built")
    resident = load_target("smollm2-135m", progress=False, weights=weights).model
    target = load_target("smollm2-135m", progress=False, weights=weights, offload="disk", resident_gb=0.0)
    st = target.model.offload
    assert st is not None and len(st.streamed) == target.config.num_layers
    tokens = _tokens(24, seed=4)
    assert torch.equal(_logits(target.model, tokens), _logits(resident, tokens))
    rng = random.Random(31)
    check_round(target.model, rng, prompt_len=16, nodes=10, tail=1, cond=0, exact=True)
    # what the KV pool is sized from: the buffers and the non-layer state, not the layers
    assert target.model.weight_bytes() < resident.weight_bytes() // 2


def test_the_resident_budget_is_respected(tmp_path: Path) -> None:
    layout = offload.float_layout(_entry(tmp_path, _tiny_model()))
    span, total = layout.max_span, layout.layer_bytes
    for budget in (0, span, 3 * span, 5 * span, total - 1, total, 10 * total):
        keep, buffers = offload.plan_resident(layout, budget, extra_per_buffer=span)
        held = sum(layout.layers[i].nbytes for i in keep)
        if len(keep) == len(layout.layers):
            assert budget >= total and buffers == 0
        else:
            assert buffers == 4 * span
            assert held + buffers <= max(budget, buffers)  # only the buffers may exceed a tiny budget
            assert keep == set(range(len(keep)))  # the first layers stay
    model, st = _streamed(layout.path.parent, tmp_path, 2)
    held = sum(int(b.numel()) for b in st.buffers) + st.resident_bytes
    assert held <= st.budget_bytes and st.held_bytes >= held
    non_layer = sum(p.numel() * p.element_size() for p in model.parameters())
    # the layers held and the non-layer state, plus at most the head's packed copy (oneDNN; the
    # token table itself may be left on disk: offload.TableRows)
    head = model.config.vocab_size * model.config.hidden_size * 4
    assert non_layer + held <= model.weight_bytes() <= non_layer + held + head


def test_a_truncated_file_is_refused_at_start(tmp_path: Path) -> None:
    entry = _entry(tmp_path, _tiny_model())
    data = entry / "weights.bin"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size - 3 * disk_io.ALIGN)
    with pytest.raises(offload.OffloadError, match="truncated"):
        offload.float_layout(entry)
    # a GGUF cut short: the layout names the layer whose blocks run past the end
    path = tmp_path / "t.gguf"
    write_llama_gguf(path, _tiny_model(layers=3))
    from shared.model.gguf_loader import open_gguf
    from shared.model.offload_layout import _check_layers

    reader = open_gguf(path)
    c = make_tiny_config(num_layers=3)
    layout = offload.gguf_layout(path, reader, 3, c.num_heads, c.num_kv_heads)
    del reader
    cut = tmp_path / "cut.gguf"
    shutil.copy(path, cut)
    with cut.open("r+b") as f:
        f.truncate(layout.layers[-1].offset + 100)
    with pytest.raises(offload.OffloadError, match="truncated"):
        _check_layers(layout.layers, cut)


def test_a_corrupt_file_is_refused_and_never_gives_a_wrong_token(tmp_path: Path) -> None:
    entry = _entry(tmp_path, _tiny_model())
    model, st = _streamed(entry, tmp_path, 1)  # records the checksums
    good = _logits(model, _tokens())
    span = st.layout.layers[3]
    data = entry / "weights.bin"

    def flip() -> None:
        with data.open("r+b") as f:
            f.seek(span.offset + span.slots[0].offset + 1000)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))

    flip()
    # while serving: the next read of layer 3 fails loudly instead of computing with it
    with pytest.raises(offload.OffloadError, match="layer 3"):
        for _ in range(3):
            _logits(model, _tokens())
    st.close()
    # at the next start: refused before any forward
    with pytest.raises(offload.OffloadError, match=r"layer 3.*corrupt"):
        _streamed(entry, tmp_path, 1)
    flip()  # repaired: the same logits again
    model, st = _streamed(entry, tmp_path, 1)
    assert torch.equal(_logits(model, _tokens()), good)


def test_a_slow_disk_only_slows(tmp_path: Path) -> None:
    entry = _entry(tmp_path, _tiny_model())
    model, fast = _streamed(entry, tmp_path, 1)
    want = _logits(model, _tokens())
    slow_model, slow = _streamed(entry, tmp_path, 1, delay_s=0.03)
    assert torch.equal(_logits(slow_model, _tokens()), want)
    assert slow.stats.wait_s > fast.stats.wait_s and slow.stats.read_s >= 0.03 * (LAYERS - 1)


def test_serve_takes_the_offload_flags() -> None:
    from cloud_verifier.cli import build_parser
    from cloud_verifier.server_config import ServerConfig

    out = subprocess.run(
        [sys.executable, "-m", "cloud_verifier", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    for flag in ("--offload", "--resident-gb", "--offload-threads"):
        assert flag in out
    args = build_parser().parse_args(["serve", "--offload", "disk", "--resident-gb", "1.5"])
    assert (args.offload, args.resident_gb) == ("disk", 1.5)
    with pytest.raises(ValueError, match="resident_gb"):
        ServerConfig(offload="disk", resident_gb=-1.0)


def test_greedy_rounds_through_the_engine_give_the_tokens_of_the_target_alone(tmp_path: Path) -> None:
    """The step runner batches rounds into one streamed pass: its greedy tokens are the resident
    target's, and the cost curve's cache key says the layers stream."""
    from cloud_verifier.cost import cost_cache_key

    resident = _tiny_model()
    model, st = _streamed(_entry(tmp_path, resident), tmp_path, 1)
    target = _target(model)
    rng = random.Random(8)
    for k in range(3):
        prompt = prompt_tokens(40 + k, 6 + 2 * k)
        ref = greedy_generate(resident, resident.new_kv_cache(256, 16), prompt, 12, eos_ids=target.eos_ids)
        assert tree_generation(target, prompt, ref, rng) == ref
    assert st.stats.forwards > 3
    plain = _target(resident)
    assert cost_cache_key(target, 1, (1, 2), 8) != cost_cache_key(plain, 1, (1, 2), 8)


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


def test_the_service_refuses_what_it_cannot_stream(capsys: pytest.CaptureFixture[str]) -> None:
    from cloud_verifier.cli import main

    assert main(["serve", "--model", "tiny", "--offload", "disk", "--tensor-parallel", "2"]) == 2
    assert "--offload does not combine with --tensor-parallel" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny", "--offload", "disk", "--resident-gb", "-2"]) == 2
    assert "argument --resident-gb: -2 is out of range" in capsys.readouterr().err
    with pytest.raises(ValueError, match="offload must be one of"):
        load_target("tiny", progress=False, offload="tape")


def test_load_target_streams_tiny_from_a_weight_cache_entry_it_writes() -> None:
    resident = load_target("tiny", progress=False)
    streamed = load_target("tiny", progress=False, offload="disk", resident_gb=0.0)
    st = streamed.model.offload
    assert st is not None and st.streamed == list(range(streamed.config.num_layers))
    tokens = _tokens(12, seed=9)
    assert torch.equal(_logits(streamed.model, tokens), _logits(resident.model, tokens))
    assert streamed.vocab_fingerprint == resident.vocab_fingerprint


def test_the_first_streamed_start_writes_the_cache_a_parameter_at_a_time(tmp_path: Path) -> None:
    """fill_from_gguf: the float-weight cache entry written from the GGUF one parameter at a time
    (each freed once written, so a target larger than memory can make its entry) holds exactly the
    bytes of the entry written from the whole loaded model (SmolLM2: a `llama` file with permuted
    q/k rows and tied embeddings)."""
    from shared.model import gguf_loader
    from shared.model.target import _gguf_tokenizer, smollm2_gguf_path

    path = smollm2_gguf_path()
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.config_from_gguf(reader)
    tokenizer = _gguf_tokenizer(str(path), reader)
    whole = build_model(config, None, "float32", "cpu")
    gguf_loader.load_gguf_weights(reader, whole, progress=False)
    assert weight_cache.save(tmp_path / "whole", whole, tokenizer, progress=False)
    del whole
    shell = build_model(config, None, "float32", "cpu")
    written: list[str] = []

    def fill(write: Callable[[str, torch.Tensor], None]) -> None:
        def spy(name: str, p: torch.Tensor) -> None:
            written.append(name)
            write(name, p)

        gguf_loader.fill_from_gguf(reader, shell, spy)

    assert weight_cache.save(tmp_path / "streamed", shell, tokenizer, progress=False, fill=fill)
    a, b = ((tmp_path / d / "weights.bin").read_bytes() for d in ("whole", "streamed"))
    assert a == b
    assert (tmp_path / "whole" / "header.json").read_text() == (
        tmp_path / "streamed" / "header.json"
    ).read_text()
    # every parameter was handed over once, then freed
    assert sorted(written) == sorted(n for n, _ in shell.named_parameters(remove_duplicate=True))
    assert all(p.numel() == 0 for p in shell.parameters())


def test_a_budget_below_the_stream_buffers_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Streaming needs its buffers whatever the budget: below them the weights hold the buffers, a
    warning says so, and held_bytes shows what is held."""
    layout = offload.float_layout(_entry(tmp_path, _tiny_model()))
    with caplog.at_level("WARNING", logger="shared.model.offload"):
        st = offload.attach(_tiny_model(), layout, layout.max_span / 1e9, sidecar=tmp_path / "checksums.json")
    assert st.held_bytes > st.budget_bytes and not st.resident
    assert "below what streaming needs" in caplog.text
    st.close()


def test_the_services_kv_pool_comes_out_of_the_resident_budget() -> None:
    """serve --offload: --resident-gb N holds the KV pool first and the weights get what it leaves
    (tiny: 2 layers of 0.56 MB, a pool of 64 blocks 0.79 MB). The pool reserved before the weights
    load is never smaller than the one the service then makes, automatic or set."""
    from cloud_verifier.kv_pool import kv_blocks_for, kv_reserve_bytes, token_bytes
    from cloud_verifier.server import load_configured
    from cloud_verifier.server_config import ServerConfig
    from shared.model.target import streamed_config

    base = ServerConfig(model="tiny", offload="disk", kv_blocks=64)
    reserve = kv_reserve_bytes(base, streamed_config("tiny"))
    assert reserve == 64 * base.block_size * 768  # K, V and the CPU kernel's copy of K: 2 layers x 2 x 16
    layer_bytes = 2 * 561_152
    # 1.5 MB holds both layers alone, but not once the pool is out; 2.0 MB holds the pool and both
    tight_gb = (layer_bytes + reserve) / 1e9 - 0.0005
    assert tight_gb * 1e9 > layer_bytes
    tight = load_configured(replace(base, resident_gb=tight_gb))
    roomy = load_configured(replace(base, resident_gb=(layer_bytes + reserve) / 1e9 + 0.0001))
    assert tight.model.offload is not None and roomy.model.offload is not None
    assert tight.model.offload.budget_bytes == int((tight_gb - reserve / 1e9) * 1e9)
    assert tight.model.offload.streamed == [0, 1] and roomy.model.offload.streamed == []
    tokens = _tokens(9, seed=4)
    assert torch.equal(_logits(tight.model, tokens), _logits(roomy.model, tokens))
    for cfg in (base, replace(base, kv_blocks=0)):
        made = kv_blocks_for(cfg, roomy) * cfg.block_size
        kernel_copy = roomy.model.attention_kernel == "cpu-invariant"
        per_token = token_bytes(roomy.config, roomy.dtype, kernel_copy)
        assert 0 < made * per_token <= kv_reserve_bytes(cfg, roomy.config)
