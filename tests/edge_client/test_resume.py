"""Generations that survive a dropped link or a verifier restart: the client reconnects, re-sends
the committed tokens and goes on; the output equals an uninterrupted run, with no token lost or
repeated (greedy and seeded match), and it fails over across several verifier URLs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from edge_client.client import EdgeClient, GenerationError, ResumeConfig
from edge_client.drafters.registry import create_drafter
from tests.cloud_verifier.service import LiveServer, reference
from tests.cloud_verifier.test_lifecycle import _free_port

PROMPT = [5, 6, 7, 8, 9, 10, 11]


async def _run(
    client: EdgeClient, n: int, on_chunk: Callable[[int], None] | None = None, **kw: Any
) -> list[int]:
    got = 0
    async for _ in client.generate(PROMPT, max_new_tokens=n, raw=True, **kw):
        got += 1
        if callable(on_chunk):
            on_chunk(got)
    assert client.last is not None
    return list(client.last.tokens)


def test_failover_to_another_replica_mid_generation() -> None:
    drafter = create_drafter("torch", "tiny")
    with LiveServer() as a, LiveServer() as b:

        def stop_a(chunks: int) -> None:
            if chunks == 2:
                a.stop()  # graceful shutdown: the session is closed with 1001

        async def main() -> tuple[list[int], int]:
            c = EdgeClient([a.ws, b.ws], drafter, resume=ResumeConfig(backoff_s=0.05))
            out = await _run(c, 80, stop_a)
            assert c.last is not None
            resumes = c.last.stats.resumes
            await c.close()
            return out, resumes

        out, resumes = asyncio.run(main())
    drafter.close()
    assert out == reference(tuple(PROMPT), 80)
    assert resumes == 1


def _serve(port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "cloud_verifier.cli", "serve", "--model", "tiny", "--port", str(port),
           "--no-measure-cost", "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("mode", ["greedy", pytest.param("match", marks=pytest.mark.slow)])
def test_resume_after_the_verifier_is_killed_and_restarted(mode: str) -> None:
    """SIGKILL mid-generation, a new verifier process on the same port seconds later: the stream
    goes on with exactly the tokens of an uninterrupted run."""
    drafter = create_drafter("torch", "tiny")
    port = _free_port()
    url = f"ws://127.0.0.1:{port}/v1/session"
    procs = [_serve(port)]
    kw = {"mode": mode, "temperature": 0.8 if mode == "match" else 0.0, "seed": 4}
    try:
        deadline = time.monotonic() + 120
        while True:  # wait for the first process to serve
            try:
                asyncio.run(EdgeClient(url, drafter, resume=False).connect())
                break
            except GenerationError:
                assert time.monotonic() < deadline
                time.sleep(0.2)

        def kill(chunks: int) -> None:
            if chunks == 3:
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()
                procs.append(_serve(port))

        async def main() -> tuple[list[int], int]:
            c = EdgeClient(url, drafter, resume=ResumeConfig(attempts=60, backoff_s=0.2, max_backoff_s=1.0))
            out = await _run(c, 60, kill, **kw)
            assert c.last is not None
            n = c.last.stats.resumes
            await c.close()
            return out, n

        out, resumes = asyncio.run(main())

        async def uninterrupted() -> list[int]:
            c = EdgeClient(url, drafter)
            o = await _run(c, 60, None, **kw)
            await c.close()
            return o

        want = asyncio.run(uninterrupted())
    finally:
        for p in procs:
            p.kill()
            p.wait()
        drafter.close()
    assert resumes == 1
    assert out == want
    if mode == "greedy":
        assert out == reference(tuple(PROMPT), 60)


def test_a_verifier_that_comes_back_with_another_model_is_an_error() -> None:
    """Failing over to a replica that serves another model stops the generation with a clear error
    (its tokens would not continue the same target's output)."""
    from dataclasses import replace

    drafter = create_drafter("torch", "tiny")
    with LiveServer() as a, LiveServer() as b:
        assert b.state.info is not None
        b.state.info = replace(b.state.info, model_id="another-model")

        def stop_a(chunks: int) -> None:
            if chunks == 1:
                a.stop()

        async def main() -> None:
            c = EdgeClient([a.ws, b.ws], drafter, resume=ResumeConfig(backoff_s=0.05, attempts=3))
            await _run(c, 80, stop_a)

        with pytest.raises(GenerationError, match="another model"):
            asyncio.run(main())
    drafter.close()
