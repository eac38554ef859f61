"""EdgeClient's settings (edge_client.client_config): an EdgeConfig or its fields by keyword, a
generation's SamplingOptions likewise, the session the client holds and reads through to, and the
PrespecConfig settings that are enums."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from edge_client.client import EdgeClient
from edge_client.client_config import EdgeConfig, SamplingOptions, with_keywords
from edge_client.session import ResumeConfig, Session
from edge_client.speculation import PrespecConfig
from edge_client.speculation.config import Allocation, BackupPolicy
from tests.edge_client.fake_drafter import FakeDrafter


def _client(*args: object, **kw: object) -> EdgeClient:
    return EdgeClient("ws://127.0.0.1:9/v1/session", FakeDrafter(64), *args, **kw)  # type: ignore[arg-type]


def test_keywords_build_the_config_and_replace_a_given_ones() -> None:
    c = _client(prespec=True, couple=False, resume=False)
    assert c.config == EdgeConfig(prespec=True, couple=False, resume=False)
    assert isinstance(c.prespec, PrespecConfig) and c.resume is None
    base = EdgeConfig(trace=True, resume=ResumeConfig(attempts=3))
    d = _client(base, trace=False)
    assert d.config == dataclasses.replace(base, trace=False) and d.resume == ResumeConfig(attempts=3)


def test_an_unknown_keyword_names_the_fields() -> None:
    with pytest.raises(TypeError, match=r"EdgeClient\(\) got unexpected keyword arguments prespek .*prespec"):
        _client(prespek=True)
    with pytest.raises(TypeError, match=r"generate\(\) got unexpected keyword arguments temprature"):
        with_keywords(SamplingOptions(), {"temprature": 1.0}, "generate()")


def test_sampling_keywords_replace_the_options_fields() -> None:
    s = with_keywords(SamplingOptions(seed=3), {"temperature": 0.7, "max_new_tokens": 9}, "generate()")
    assert s == SamplingOptions(max_new_tokens=9, temperature=0.7, seed=3)


def test_the_client_holds_a_session_and_reads_through_to_it() -> None:
    c = _client(api_key="k", timeouts=None)
    assert isinstance(c.session, Session) and not isinstance(c, Session)
    assert c.session.api_key == "k" and c.welcome is None and c.proto is c.session.proto
    assert c.session.vocab_fingerprint() == c.vocab_fingerprint() == FakeDrafter(64).vocab_fingerprint()
    assert c.server == "ws://127.0.0.1:9/v1/session" and c.resumes == []
    asyncio.run(c.close())


def test_prespec_enums_take_their_strings_and_name_the_allowed_values() -> None:
    cfg = PrespecConfig(allocation="top", backup="chain")
    assert cfg.allocation is Allocation.TOP and cfg.backup is BackupPolicy.CHAIN
    assert str(cfg.backup) == "chain" and f"{cfg.backup}" == "chain" and json.dumps(cfg.backup) == '"chain"'
    assert PrespecConfig().backup is BackupPolicy.AUTO
    with pytest.raises(
        ValueError, match=r"PrespecConfig\.allocation must be 'geometric', 'top' or 'uniform'"
    ):
        PrespecConfig(allocation="best")
