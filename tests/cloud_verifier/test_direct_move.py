"""A session moved to its verifier's own address (welcome.direct): the client's hello there names the
session's resume token and carries the same session on, its first connection idle until the session
ends; outputs identical to the target's, a drop after the move resumes, and nobody else's hello (no
key, another vocabulary, a session already prompted) takes a session over.

The verifier here offers its own address under another host name (`localhost` for `127.0.0.1`), so
one server plays a fleet's proxy (the address the client was given) and the replica behind it."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from edge_client.client import EdgeClient, ResumeConfig
from edge_client.drafters.registry import create_drafter
from shared.messages import (
    FEATURE_DIRECT,
    FEATURE_RESUME,
    Error,
    Hello,
    Mode,
    Prompt,
    SessionLimits,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.protocol import ClientProtocol
from shared.server_protocol import ServerProtocol
from tests.cloud_verifier.service import LiveServer, reference, tiny
from tests.cloud_verifier.test_resume_kv import _abort

PROMPT = [5, 6, 7, 8, 9, 10, 11]
FEATURES = (FEATURE_RESUME, FEATURE_DIRECT)


def _direct(server: LiveServer) -> str:
    """The server's address under another name: what it offers as its own."""
    url = server.ws.replace("127.0.0.1", "localhost")
    assert url != server.ws
    server.state.direct = url
    return url


def test_the_welcome_offers_the_address_only_to_a_client_that_asked() -> None:
    limits = SessionLimits()
    w = Welcome(
        "1", "m", 100, (0,), (Mode.GREEDY,), limits, {1: 1.0}, resume="r.a", direct="ws://h:1/v1/session"
    )
    sent = []
    for features in ((), (FEATURE_DIRECT,), FEATURES):
        proto = ServerProtocol(vocab_size=100, limits=limits)
        proto.receive(encode(Hello(vocab_fingerprint="f", features=features)))
        proto.welcome(w)
        (frame,) = proto.data_to_send()
        got = decode(frame)
        assert isinstance(got, Welcome)
        sent.append(got.direct)
    # (without session.resume there is no token to move the session by)
    assert sent == [None, None, "ws://h:1/v1/session"]
    with pytest.raises(Exception, match="direct"):
        decode(encode(Welcome("1", "m", 100, (0,), (Mode.GREEDY,), limits, {1: 1.0}, direct="http://x")))


@pytest.mark.parametrize("mode", ["greedy", "match"])
def test_a_moved_session_generates_exactly_and_resumes_after_a_drop(mode: str) -> None:
    drafter = create_drafter("torch", "tiny")
    kw: dict[str, Any] = {"mode": mode, "temperature": 0.8 if mode == "match" else 0.0, "seed": 3}
    with LiveServer() as server:
        direct = _direct(server)
        seen: list[tuple[int, int]] = []

        async def generate(drop_at: int | None) -> tuple[list[int], int, int]:
            c = EdgeClient(server.ws, drafter, resume=ResumeConfig(backoff_s=0.05))
            got = 0
            async for _ in c.generate(PROMPT, max_new_tokens=60, raw=True, **kw):
                got += 1
                if got == 2:  # one session, held by two connections (the first one idle)
                    seen.append((len(server.state.sessions), server.state.admission.in_use))
                if got == drop_at:
                    _abort(c)
            assert c.last is not None and c.session.server == server.ws
            out, resumes, moves = list(c.last.tokens), c.last.stats.resumes, c.session.moves
            await c.close()
            return out, resumes, moves

        want, _, moves = asyncio.run(generate(None))
        got, resumes, moves_after_drop = asyncio.run(generate(3))
        metrics = server.state.metrics
        moved = metrics.direct_moves._value.get()
        kv = {k: metrics.resumes.labels(kv=k)._value.get() for k in ("reused", "busy", "gone")}
        for _ in range(100):  # the idle first connections see their sessions end
            if not server.state.sessions:
                break
            asyncio.run(asyncio.sleep(0.02))
        left = (len(server.state.sessions), server.state.admission.in_use, len(server.state.offers))
    drafter.close()
    assert direct.startswith("ws://localhost:")
    assert moves == 1 and moves_after_drop == 2 and moved == 3  # the resumed session moved too
    assert seen == [(1, 1), (1, 1)]
    assert resumes == 1 and got == want
    if mode == "greedy":
        assert want == reference(tuple(PROMPT), 60)
    # the resume went through the first address, named the dropped session and moved again: the
    # moved session took the parked KV cache over (or prefilled it, its last round still running)
    assert kv["gone"] == 0 and kv["reused"] + kv["busy"] == 1
    assert left == (0, 0, 0)


async def _open(
    url: str, features: tuple[str, ...] = FEATURES, **hello: Any
) -> tuple[Any, ClientProtocol, Any]:
    """A raw connection: (the socket, its protocol, the answer to its hello)."""
    from websockets.asyncio.client import connect

    ws: Any = await connect(url, max_size=None)
    proto = ClientProtocol()
    fp = hello.pop("vocab_fingerprint", tiny().vocab_fingerprint)
    await ws.send(proto.hello(Hello(vocab_fingerprint=fp, features=features, **hello)))
    return ws, proto, proto.receive(await ws.recv())


async def _generate(ws: Any, proto: ClientProtocol, n: int) -> list[int]:
    await ws.send(proto.prompt(Prompt(np.asarray(PROMPT), Mode.AR, max_new_tokens=n)))
    out: list[int] = []
    while True:
        msg = proto.receive(await ws.recv())
        assert isinstance(msg, Verdict), msg
        out.extend(msg.tokens.tolist())
        if msg.done:
            return out


def test_only_the_sessions_own_client_takes_it_over_and_only_before_its_first_prompt() -> None:
    with LiveServer() as server:
        direct = _direct(server)

        async def main() -> dict[str, Any]:
            r: dict[str, Any] = {}
            first, _, w = await _open(server.ws)
            assert isinstance(w, Welcome) and w.direct == direct and w.resume
            # another vocabulary naming the token: refused as any such hello is, the offer kept
            ws, _, answer = await _open(direct, resume=w.resume, vocab_fingerprint="0" * 64)
            r["other vocabulary"] = isinstance(answer, Error)
            await ws.close()
            r["offered"] = list(server.state.offers) == [w.resume]
            # the session's client: the same session, welcomed again on this connection
            ws, proto, moved = await _open(direct, resume=w.resume)
            r["same session"] = isinstance(moved, Welcome) and moved.session_id == w.session_id
            r["offer gone"] = not server.state.offers
            r["tokens"] = await _generate(ws, proto, 12)
            await ws.close()
            # the first connection, idle since the move, is closed once the session ends
            await asyncio.wait_for(first.wait_closed(), 10)
            r["first closed"] = first.close_code
            # a session already prompted keeps its connection: a hello naming it opens its own
            first, fproto, w = await _open(server.ws)
            r["first's tokens"] = await _generate(first, fproto, 5)
            ws, _, other = await _open(direct, resume=w.resume)
            r["own session"] = isinstance(other, Welcome) and other.session_id != w.session_id
            await ws.close()
            await first.close()
            return r

        r = asyncio.run(main())
        moved = server.state.metrics.direct_moves._value.get()
    ref = reference(tuple(PROMPT), 12)
    assert r == {
        "other vocabulary": True,
        "offered": True,
        "same session": True,
        "offer gone": True,
        "tokens": ref,
        "first closed": 1000,
        "first's tokens": ref[:5],
        "own session": True,
    }
    assert moved == 1


def test_no_offer_without_an_address_or_to_a_client_that_did_not_ask() -> None:
    with LiveServer() as server:

        async def main() -> list[str | None]:
            got = []
            for features in (FEATURES, (FEATURE_RESUME,)):
                ws, _, w = await _open(server.ws, features=features)
                assert isinstance(w, Welcome)
                got.append(w.direct)
                await ws.close()
                _direct(server)
            return got

        got = asyncio.run(main())
    assert got == [None, None]
