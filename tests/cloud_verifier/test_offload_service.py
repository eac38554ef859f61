"""Streamed weights in the service: serve's offload flags, greedy rounds through the engine equal to
the target alone, what cannot stream refused, load_target writing and streaming a weight-cache
entry a parameter at a time, a budget under the stream buffers named, the KV pool out of the
resident budget."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.model import (
    build_model,
    load_target,
    offload,
    weight_cache,
)
from shared.model.generate import greedy_generate
from tests.cloud_verifier.offload_helpers import ROOT, _entry, _logits, _streamed, _tiny_model, _tokens
from tests.cloud_verifier.service import prompt_tokens
from tests.cloud_verifier.test_quantized_model import _target, tree_generation


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
