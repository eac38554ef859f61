"""The automatic KV pool (cloud_verifier/kv_pool.py): a stated fraction of the memory available once
the weights are loaded, at most what every session at its longest can use, at least one full
context where memory holds it; the service logs the sizing in one line."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cloud_verifier.kv_pool import available_bytes, meminfo_available, memory_blocks
from cloud_verifier.server_config import ServerConfig
from tests.cloud_verifier.service import service

GB = 10**9
PER_TOKEN = 768  # bytes a token takes in the pool (tiny's K, V and the CPU kernel's copy of K)


def test_the_pool_is_the_stated_fraction_of_available_memory() -> None:
    cfg = ServerConfig(
        model="tiny", max_sessions=10_000, max_context=4096, max_nodes=64, kv_memory_fraction=0.5
    )
    blocks = memory_blocks(cfg, PER_TOKEN, available=2 * GB)
    assert blocks == GB // PER_TOKEN // 16  # half of 2 GB, in whole blocks of 16 tokens
    # another fraction of the same memory: proportionally more
    more = replace(cfg, kv_memory_fraction=0.9)
    assert memory_blocks(more, PER_TOKEN, available=2 * GB) == int(0.9 * (2 * GB)) // PER_TOKEN // 16


def test_the_pool_is_capped_at_every_session_at_its_longest_and_holds_one_where_memory_does() -> None:
    cfg = ServerConfig(model="tiny", max_sessions=4, max_context=1000, max_nodes=23, kv_memory_fraction=0.5)
    one = 1000 + 23 + 1
    assert memory_blocks(cfg, PER_TOKEN, 1000 * GB) * 16 == 4 * one  # no more than 4 sessions can use
    # a fraction too small for one context: still one full context, the memory holds it
    small = replace(cfg, kv_memory_fraction=0.001)
    assert memory_blocks(small, PER_TOKEN, one * PER_TOKEN * 10) * 16 == one
    # memory that cannot hold one context: what it holds (at least 8 blocks)
    assert memory_blocks(small, PER_TOKEN, 50 * 16 * PER_TOKEN) == 50
    # memory that cannot be read: a fixed budget, at least one context
    assert memory_blocks(small, PER_TOKEN, None) * 16 == 4 * one


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    12345678 kB\n")
    assert meminfo_available(str(info)) == 12345678 * 1024
    info.write_text("MemTotal: 1 kB\n")
    assert meminfo_available(str(info)) is None
    assert meminfo_available(str(tmp_path / "none")) is None
    here = available_bytes(torch.device("cpu"))
    assert here is None or here > 0


def test_the_service_logs_its_pool_sizing_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="cloud_verifier"):
        with service(kv_blocks=0, kv_memory_fraction=0.25):
            pass
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]
    # 8 sessions of 512 + 64 + 1 tokens: far less than a quarter of any machine's memory
    assert "blocks of 16 tokens" in line and "tokens," in line and " GB" in line
    assert "kv_memory_fraction 0.25 of" in line or "could not be read" in line


def test_the_fraction_is_a_flag_and_a_variable_and_a_share_outside_0_to_1_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cloud_verifier.cli import build_parser

    args = build_parser().parse_args(["serve", "--kv-memory-fraction", "0.3"])
    assert args.kv_memory_fraction == 0.3
    for bad in ("0", "1.5", "nan"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", "--kv-memory-fraction", bad])
        assert exc.value.code == 2
        (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
        assert "--kv-memory-fraction" in line
    monkeypatch.setenv("CLOUD_VERIFIER_KV_MEMORY_FRACTION", "0.2")
    assert ServerConfig.from_env().kv_memory_fraction == 0.2
