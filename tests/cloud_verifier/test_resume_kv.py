"""A dropped session's KV cache kept for its client's resume: the token in the welcome, the parked
sequence claimed by the resume's hello and taken over at its prompt, the engine keeping the common
prefix of its cache, and outputs identical to an uninterrupted run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from cloud_verifier.resume import ParkedSessions, new_token, token_tag
from cloud_verifier.step import common_prefix
from edge_client.client import EdgeClient, ResumeConfig
from edge_client.drafters.registry import create_drafter
from shared.messages import FEATURE_RESUME, Hello, Mode, Prompt, SessionLimits, Welcome, decode, encode
from shared.server_protocol import ServerProtocol
from tests.cloud_verifier.service import LiveServer, prompt_tokens, reference
from tests.cloud_verifier.test_engine import _engine

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@dataclass
class _Seq:
    sid: int
    working: bool = False


@dataclass
class _Engine:
    closed: list[int] = field(default_factory=list)

    def close(self, s: Any) -> None:
        self.closed.append(s.sid)


def test_tokens_name_their_replica_and_cannot_be_guessed() -> None:
    a, b = new_token("replica-7"), new_token("replica-7")
    assert a != b and token_tag(a) == "replica-7" and len(a) > len("replica-7.") + 20
    assert token_tag(new_token("")) == "" and "." not in new_token("")


def test_a_parked_sequence_is_claimed_once_by_its_owner_and_expires() -> None:
    e = _Engine()
    p = ParkedSessions(keep_s=10.0, max_parked=2)
    seq: Any = _Seq(1)
    p.park("t1", seq, e, "alice")  # type: ignore[arg-type]
    assert p.tokens() == ["t1"] and len(p) == 1
    assert p.claim("t1", "mallory") is None and len(p) == 1  # someone else's key: refused, kept
    assert p.claim("nope", "alice") is None
    assert p.claim("t1", "alice") is seq and len(p) == 0 and e.closed == []  # the claimer owns it
    assert p.claim("t1", "alice") is None  # once
    for i in (2, 3, 4):  # over max_parked: the oldest is freed
        p.park(f"t{i}", _Seq(i), e, "alice")  # type: ignore[arg-type]
    assert p.tokens() == ["t3", "t4"] and e.closed == [2]
    assert p.expire(now=1e18) == 2 and e.closed == [2, 3, 4] and len(p) == 0


def test_nothing_is_parked_when_resuming_is_off() -> None:
    e = _Engine()
    p = ParkedSessions(keep_s=0.0)
    assert p.new_token() is None
    p.park("t", _Seq(5), e, "alice")  # type: ignore[arg-type]
    assert len(p) == 0 and e.closed == [5]


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4], 10) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix([9], [1], 5) == 0 and common_prefix([], [1], 5) == 0


def test_hello_and_welcome_carry_the_token_only_where_asked() -> None:
    h = Hello(vocab_fingerprint="f", features=(FEATURE_RESUME,), resume="r.abc")
    assert _resume(_frame(h)) == "r.abc"
    with pytest.raises(Exception, match="resume"):
        decode(_frame(Hello(vocab_fingerprint="f", resume="x" * 200)))
    limits = SessionLimits()
    proto = ServerProtocol(vocab_size=100, limits=limits)
    proto.receive(_frame(Hello(vocab_fingerprint="f")))
    w = Welcome("1", "m", 100, (0,), (Mode.GREEDY,), limits, {1: 1.0}, resume="r.abc")
    proto.welcome(w)
    (frame,) = proto.data_to_send()
    assert _resume(frame) is None  # a client that did not name session.resume: not sent
    proto = ServerProtocol(vocab_size=100, limits=limits)
    proto.receive(_frame(Hello(vocab_fingerprint="f", features=(FEATURE_RESUME,))))
    proto.welcome(w)
    (frame,) = proto.data_to_send()
    assert _resume(frame) == "r.abc"


def _frame(msg: Any) -> bytes:
    return encode(msg)


def _resume(frame: bytes) -> str | None:
    """The `resume` of a hello or welcome frame."""
    msg = decode(frame)
    assert isinstance(msg, (Hello, Welcome))
    return msg.resume


def test_the_engine_keeps_the_cache_of_the_common_prefix() -> None:
    """A sequence started again on a session whose cache holds a longer sequence sharing a prefix
    keeps that prefix's cache (no prefill of it) and decodes exactly as a fresh session."""
    prompt = prompt_tokens(71, 9)
    ref = reference(tuple(prompt), 12)
    again = prompt + ref[:5]  # the resume's prompt: the prompt and what the client had committed
    e = _engine(gather_ms=0)
    outs: list[list[int]] = []
    cached: list[int] = []

    async def main() -> None:
        s = e.open(lambda r: None)
        e.start_loop()

        async def generate(toks: list[int], n: int) -> list[int]:
            done, got = asyncio.Event(), []

            def cb(r: Any) -> None:
                got.extend(r.tokens)
                if r.done:
                    done.set()
                else:
                    e.submit(s, r.round + 1, None)

            s.on_result = cb
            e.start(s, Prompt(np.asarray(toks), Mode.GREEDY, max_new_tokens=n), np.asarray(toks))
            cached.append(e.kv.cached_len(s.sid))
            await asyncio.wait_for(done.wait(), 60)
            return got

        outs.append(await generate(prompt, 12))
        cached.append(e.kv.cached_len(s.sid))
        outs.append(await generate(again, 7))
        outs.append(await generate(prompt_tokens(72, 4), 2))  # shares nothing: an empty cache
        await e.stop()

    asyncio.run(main())
    assert outs[0] == ref and outs[1] == ref[5:12]
    assert outs[2] == reference(tuple(prompt_tokens(72, 4)), 2)
    # fresh; all 20 committed but the last; the prefix kept, one row left to feed; nothing kept
    assert cached == [0, len(prompt) + 11, len(again) - 1, 0]


def _abort(client: EdgeClient) -> None:
    """Cut the client's TCP connection with no closing handshake (a network drop)."""
    t: Any = client.session._transport
    t._ws.transport.abort()


@pytest.mark.parametrize("mode", ["greedy", "match"])
def test_a_dropped_session_resumes_on_its_kv_cache_with_the_same_output(mode: str) -> None:
    drafter = create_drafter("torch", "tiny")
    kw: dict[str, Any] = {"mode": mode, "temperature": 0.8 if mode == "match" else 0.0, "seed": 3}
    with LiveServer() as server:

        async def generate(drop_at: int | None) -> tuple[list[int], int]:
            c = EdgeClient(server.ws, drafter, resume=ResumeConfig(backoff_s=0.05))
            got = 0
            async for _ in c.generate(PROMPT, max_new_tokens=60, raw=True, **kw):
                got += 1
                if got == drop_at:
                    _abort(c)
            assert c.last is not None
            out, resumes = list(c.last.tokens), c.last.stats.resumes
            await c.close()
            return out, resumes

        want, _ = asyncio.run(generate(None))
        got, resumes = asyncio.run(generate(3))
        m = server.state.metrics.resumes
        reused, busy = m.labels(kv="reused")._value.get(), m.labels(kv="busy")._value.get()
        gone = m.labels(kv="gone")._value.get()
        parked = len(server.state.parked)
    drafter.close()
    assert resumes == 1 and got == want
    if mode == "greedy":
        assert got == reference(tuple(PROMPT), 60)
    # the resume found its session and took its cache over (or, its last round still running,
    # prefilled the prompt): the server parked it before the new connection's hello
    assert gone == 0 and reused + busy == 1 and parked == 0


def test_a_verifier_that_keeps_nothing_gives_no_token() -> None:
    drafter = create_drafter("torch", "tiny")
    with LiveServer(resume_keep_s=0.0) as off, LiveServer() as on:

        async def welcome(url: str) -> Welcome:
            c = EdgeClient(url, drafter)
            w = await c.connect()
            await c.close()
            return w

        assert asyncio.run(welcome(off.ws)).resume is None
        w = asyncio.run(welcome(on.ws))
    drafter.close()
    assert w.resume is not None and token_tag(w.resume) == ""


def test_a_client_that_did_not_ask_for_resume_has_nothing_kept() -> None:
    """A hello without session.resume: no token in the welcome, and a dropped connection frees its
    session's KV cache at once (nothing is parked for a resume that cannot come)."""
    from tests.cloud_verifier.service import AsyncSession

    with LiveServer() as server:

        async def main() -> tuple[Any, int]:
            s = await AsyncSession.open(server.ws)
            w = await s.recv()
            await s.ws.send(s.proto.prompt(Prompt(np.asarray(PROMPT), Mode.AR, max_new_tokens=200)))
            await s.recv()  # the first verdict: the generation runs
            s.ws.transport.abort()
            for _ in range(250):  # the server sees the drop (and its step in flight ends)
                if not server.state.sessions and server.engine.kv.blocks_in_use == 0:
                    break
                await asyncio.sleep(0.02)
            return w, len(server.state.parked)

        welcome, parked = asyncio.run(main())
        blocks = server.engine.kv.blocks_in_use
    assert isinstance(welcome, Welcome) and welcome.resume is None
    assert parked == 0 and blocks == 0
