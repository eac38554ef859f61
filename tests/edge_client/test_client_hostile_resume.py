"""The edge client against a verifier that drops its sessions: when a dropped session is resumed,
when it is given up on, and which closes are never resumed."""

from __future__ import annotations

import asyncio

import pytest

from edge_client.client import (
    ConnectionLost,
    GenerationError,
    ResumeConfig,
)
from tests.edge_client.fake_drafter import FakeDrafter
from tests.edge_client.hostile_verifier import Honest, Liar, V, _client, _honest_tokens, _run, _tokens, liar


def test_a_verifier_that_drops_every_session_after_the_prompt_is_given_up_on() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.ws.recv()  # the prompt
        await s.ws.close(1011, "internal error")

    async def main() -> Liar:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=ResumeConfig(attempts=3, backoff_s=0.01, max_backoff_s=0.05))
            with pytest.raises(ConnectionLost, match="4 times in a row with no new token"):
                await _tokens(c, 8)
            return lv

    lv = _run(main())
    assert lv.connections == 4


def test_progress_resets_the_count_of_drops() -> None:
    """A verifier that drops each session after one verdict still gets the generation done."""
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.next()  # the prompt: answered with one token
        await s.ws.recv()
        await s.ws.close(1001, "going away")

    async def main() -> tuple[Liar, list[int]]:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=ResumeConfig(attempts=2, backoff_s=0.01))
            return lv, await _tokens(c, 6)

    lv, out = _run(main())
    assert out == _honest_tokens(6) and lv.connections == 6


def test_the_clients_own_1009_is_not_resumed() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.ws.recv()
        await s.ws.send(b"\x00" * ((1 << 22) + 1))  # over the client's 4 MiB frame limit
        await asyncio.sleep(3600)

    async def main() -> Liar:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=ResumeConfig(attempts=5, backoff_s=0.01))
            with pytest.raises(GenerationError, match="1009") as info:
                await _tokens(c, 8)
            assert not isinstance(info.value, ConnectionLost)
            return lv

    assert _run(main()).connections == 1


@pytest.mark.parametrize("code", [1002, 1003, 1007, 1008, 1009, 1000])
def test_a_close_for_a_protocol_reason_is_not_resumed(code: int) -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.ws.recv()
        await s.ws.close(code, "no")

    async def main() -> Liar:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=ResumeConfig(attempts=5, backoff_s=0.01))
            with pytest.raises(GenerationError, match=str(code)) as info:
                await _tokens(c, 8)
            assert not isinstance(info.value, ConnectionLost)
            return lv

    assert _run(main()).connections == 1
