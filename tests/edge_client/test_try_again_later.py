"""A verifier at its session cap refuses a new session with close 1013 "try again later": with
`resume`, the edge client's generation waits for room (the resume backoff) and then runs exactly;
without it, the refusal is raised at once, its close code on the error."""

from __future__ import annotations

import asyncio

import pytest

from edge_client.client import ConnectionLost, EdgeClient, ResumeConfig
from edge_client.drafters.registry import create_drafter
from tests.cloud_verifier.service import LiveServer, reference

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def test_a_full_verifier_is_waited_for_with_resume_and_refuses_at_once_without() -> None:
    drafter = create_drafter("torch", "tiny")
    with LiveServer(max_sessions=1) as server:

        async def main() -> tuple[list[int], BaseException | None]:
            holder = EdgeClient(server.ws, drafter, resume=False)
            await holder.connect()  # the one session slot
            refused: BaseException | None = None
            try:
                await EdgeClient(server.ws, drafter, resume=False).session.connect_when_room()
            except ConnectionLost as exc:
                refused = exc
            waiting = EdgeClient(server.ws, drafter, resume=ResumeConfig(backoff_s=0.05, max_backoff_s=0.1))
            gen = asyncio.create_task(_generate(waiting))
            await asyncio.sleep(0.5)
            assert not gen.done()  # still refused, trying again
            await holder.close()  # room
            out = await asyncio.wait_for(gen, 60)
            await waiting.close()
            return out, refused

        out, refused = asyncio.run(main())
        rejected = server.state.metrics.rejected_sessions._value.get()
    drafter.close()
    assert isinstance(refused, ConnectionLost) and refused.close_code == 1013
    assert out == reference(tuple(PROMPT), 24)
    assert rejected >= 3  # the refused connect and the waiting client's tries


async def _generate(c: EdgeClient) -> list[int]:
    async for _ in c.generate(PROMPT, max_new_tokens=24, raw=True):
        pass
    assert c.last is not None
    return list(c.last.tokens)


def test_without_resume_a_generation_on_a_full_verifier_fails_with_1013() -> None:
    drafter = create_drafter("torch", "tiny")
    with LiveServer(max_sessions=1) as server:

        async def main() -> None:
            holder = EdgeClient(server.ws, drafter, resume=False)
            await holder.connect()
            try:
                with pytest.raises(ConnectionLost) as info:
                    await _generate(EdgeClient(server.ws, drafter, resume=False))
                assert info.value.close_code == 1013
            finally:
                await holder.close()

        asyncio.run(main())
    drafter.close()


def test_an_upgrade_refused_with_503_is_tried_again_and_names_its_status() -> None:
    """A fleet's proxy past its queue refuses the WebSocket upgrade itself (HTTP 503, or 500): the
    error carries the status, and a generation's first connection waits it out like 1013."""
    from http import HTTPStatus

    from websockets.asyncio.server import ServerConnection, serve
    from websockets.http11 import Request, Response

    from edge_client.session import Session

    class _Session(Session):
        def vocab_fingerprint(self) -> str:
            return "0" * 64

    async def refuse(connection: ServerConnection, request: Request) -> Response:
        return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "queue full\n")

    async def handler(ws: ServerConnection) -> None:
        return None

    async def main() -> tuple[ConnectionLost, list[int], BaseException | None]:
        async with serve(handler, "127.0.0.1", 0, process_request=refuse) as server:
            port = server.sockets[0].getsockname()[1]
            s = _Session(f"ws://127.0.0.1:{port}", resume=ResumeConfig(backoff_s=0.01, max_backoff_s=0.02))
            try:
                await s.connect()
            except ConnectionLost as exc:
                refused = exc
        tries: list[int] = []

        async def connect() -> object:  # refused twice with 503, then welcomed
            tries.append(len(tries))
            if len(tries) < 3:
                raise ConnectionLost("refused", http_status=503)
            return "welcome"

        s.connect = connect  # type: ignore[method-assign, assignment]
        welcomed: object = await s.connect_when_room()
        assert welcomed == "welcome"
        gone: BaseException | None = None

        async def not_found() -> object:
            tries.append(-1)
            raise ConnectionLost("no such path", http_status=404)

        s.connect = not_found  # type: ignore[method-assign, assignment]
        try:
            await s.connect_when_room()
        except ConnectionLost as exc:
            gone = exc
        return refused, tries, gone

    refused, tries, gone = asyncio.run(main())
    assert refused.http_status == 503 and refused.try_again_later and refused.close_code is None
    assert tries == [0, 1, 2, -1]  # 503 twice then welcomed; a 404 raised at once
    assert isinstance(gone, ConnectionLost) and not gone.try_again_later
