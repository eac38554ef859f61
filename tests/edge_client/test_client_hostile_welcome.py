"""The edge client against a verifier's unusable or missing welcome and other frames out of place,
the CLI's one-line failures, and the real verifier after an abandoned generation."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest

from edge_client.client import (
    EdgeClient,
    GenerationError,
    ProtocolViolation,
)
from shared.errors import ErrorCode
from shared.messages import (
    Close,
    Prompt,
    SessionLimits,
    Verdict,
    encode,
)
from tests.edge_client.fake_drafter import FakeDrafter
from tests.edge_client.hostile_verifier import (
    FAST,
    PROMPT,
    Honest,
    Liar,
    V,
    _client,
    _honest_tokens,
    _liar_in_thread,
    _recv_bytes,
    _run,
    _tokens,
    _welcome,
    liar,
)

UNUSABLE = "unusable welcome"


NO_FORWARD = "is not a forward time"  # shared.verify_cost's rule, applied as the welcome is read


@pytest.mark.parametrize(
    ("change", "fld", "said"),
    [
        ({"vocab_fingerprint": ""}, "welcome.vocab_fingerprint", UNUSABLE),
        ({"vocab_fingerprint": "not-hex"}, "welcome.vocab_fingerprint", UNUSABLE),
        ({"vocab_fingerprint": "A" * 64}, "welcome.vocab_fingerprint", UNUSABLE),
        ({"version": 7}, "welcome.version", UNUSABLE),
        ({"allowed_modes": ()}, "welcome.allowed_modes", UNUSABLE),
        ({"eos_ids": (V,)}, "welcome.eos_ids", UNUSABLE),
        # limits outside SessionLimits.RANGES are refused as the welcome is read
        ({"limits": SessionLimits(max_nodes=0)}, "limits.max_nodes", r"must be in \[1, "),
        ({"verify_cost_ms": {1: 0.0, 32: 2.0}}, "verify_cost_ms", NO_FORWARD),
        ({"verify_cost_ms": {1: 1.0, 32: 1e308}}, "verify_cost_ms", NO_FORWARD),
    ],
)
def test_an_unusable_welcome_is_refused(change: dict[str, Any], fld: str, said: str) -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await _recv_bytes(s.ws)
        await s.ws.send(encode(_welcome(s.fingerprint, **change)))
        await asyncio.sleep(3600)

    async def main() -> Liar:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            with pytest.raises(ProtocolViolation, match=said) as info:
                await _tokens(c, 4)
            assert info.value.field == fld
            return lv

    assert _run(main()).connections == 1  # refused for a reason: not retried


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",
        encode(Verdict(0, np.asarray([1], np.int32), np.zeros(0, np.int32), True, 1)),
        encode(Close("bye")),
    ],
    ids=["garbage", "a verdict", "close"],
)
def test_no_welcome_but_something_else_is_a_generation_error(frame: bytes) -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await _recv_bytes(s.ws)
        await s.ws.send(frame)
        await asyncio.sleep(3600)

    async def main() -> None:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=False)
            with pytest.raises(GenerationError):
                await c.connect()

    _run(main())


def test_a_text_frame_is_a_protocol_violation() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.ws.recv()
        await s.ws.send("a text frame")
        await asyncio.sleep(3600)

    async def main() -> None:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            with pytest.raises(ProtocolViolation, match="text frame") as info:
                await _tokens(c, 4)
            assert info.value.code is ErrorCode.BAD_FRAME

    _run(main())


def test_a_continue_after_a_dropped_session_resends_the_context() -> None:
    """The connection is dropped between turns (a lie ended it): the next `continue_` turn sends
    the context again instead of silently starting from nothing."""
    d = FakeDrafter(V)
    sessions: list[Honest] = []

    async def script(s: Honest) -> None:
        sessions.append(s)
        await s.welcome()
        await s.next()  # the prompt
        while s.srv.gen is not None:
            await s.next()
        if len(sessions) == 1:
            await s.ws.recv()  # the next prompt: answered with garbage
            await s.ws.send(b"\xc1")
            await asyncio.sleep(3600)
        await s.serve()

    async def main() -> list[Prompt]:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            first = await _tokens(c, 3)
            with pytest.raises(ProtocolViolation):
                await _tokens(c, 3, continue_=True)
            await _tokens(c, 3, continue_=True)
            assert first == _honest_tokens(3)
            return [p for s in sessions for p in s.prompts]

    prompts = _run(main())
    last = prompts[-1]
    assert not last.continue_
    assert last.tokens.tolist() == PROMPT + _honest_tokens(3) + PROMPT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--draft", "tiny", "--server", f"ws://127.0.0.1:{_free_port()}/v1/session"], "cannot reach"),
        (["--draft", "tiny", "--server", "http://example.invalid/"], "ws://"),
        (["--draft", "/no/such/draft.gguf"], "draft.gguf"),
    ],
    ids=["refused", "bad url", "missing draft"],
)
def test_the_cli_prints_one_line_for_a_failure(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from edge_client import cli

    rc = cli.main(["generate", "hello", "--raw", "--resume-attempts", "0", "--drafter", "torch", *args])
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edge-client: error: ") and needle in lines[0], err


def test_the_cli_prints_one_line_when_the_verifier_breaks_the_protocol(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from edge_client import cli
    from edge_client.drafters.registry import create_drafter

    tiny = create_drafter("torch", "tiny")
    fp, vocab = tiny.vocab_fingerprint(), tiny.vocab_size
    tiny.close()

    async def script(s: Honest) -> None:
        await _recv_bytes(s.ws)
        await s.ws.send(encode(_welcome(fp, vocab_size=vocab)))
        await _recv_bytes(s.ws)  # the prompt
        await s.ws.send(b"\xc1")
        await asyncio.sleep(3600)

    with _liar_in_thread(script, fp) as lv:
        argv = ["generate", "hello", "--raw", "--drafter", "torch", "--draft", "tiny", "--server", lv.url]
        rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edge-client: error: the verifier broke the protocol"), err
    assert "BAD_FRAME" in lines[0]


@pytest.mark.parametrize("prespec", [False, True])
def test_after_an_abandoned_generation_the_real_verifier_session_stays_exact(prespec: bool) -> None:
    """Abandoned mid-stream twice (closed, then dropped unclosed) with conditional trees in flight:
    the same session then generates exactly the target's tokens."""
    from edge_client.drafters.registry import create_drafter
    from tests.cloud_verifier.service import LiveServer, reference

    drafter = create_drafter("torch", "tiny")
    prompt = [5, 6, 7, 8, 9, 10, 11]

    async def main(url: str) -> tuple[list[int], bool]:
        c = EdgeClient(url, drafter, prespec=prespec, timeouts=FAST)
        agen = c.generate(prompt, max_new_tokens=200, raw=True)
        async for _ in agen:
            break
        await agen.aclose()
        session = c.welcome
        dropped = c.generate(prompt, max_new_tokens=200, raw=True)
        await dropped.__anext__()  # left open
        out = await _tokens_of(c, prompt, 40)
        same = c.welcome is session and session is not None
        await c.close()
        return out, same

    try:
        with LiveServer() as srv:
            out, same_session = _run(main(srv.ws), 120)
    finally:
        drafter.close()
    assert out == reference(tuple(prompt), 40)
    assert same_session


async def _tokens_of(c: EdgeClient, prompt: list[int], n: int) -> list[int]:
    async for _ in c.generate(prompt, max_new_tokens=n, raw=True):
        pass
    assert c.last is not None
    return list(c.last.tokens)
