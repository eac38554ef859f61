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
