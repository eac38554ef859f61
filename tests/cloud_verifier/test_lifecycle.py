"""The verifier as a process: SIGTERM drains running generations and exits 0; a model that cannot
be loaded ends the process with one clear line; a client whose verifier dies gets GenerationError."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from websockets.frames import Close

from shared.messages import Mode, Prompt, Verdict, Welcome
from tests.cloud_verifier.service import AsyncSession, prompt_tokens, reference


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def verifier_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """`cloud-verifier serve --model tiny` in its own process, ready (or failed) on return."""
    port = _free_port()
    cmd = [sys.executable, "-m", "cloud_verifier.cli", "serve", "--model", "tiny", "--port", str(port)]
    cmd += ["--no-measure-cost", "--log-level", "warning", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        if proc.poll() is not None:
            stderr = proc.stderr.read() if proc.stderr is not None else ""
            raise AssertionError(f"the verifier exited with {proc.returncode}: {stderr[-2000:]}")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_sigterm_drains_running_generations_then_exits_0() -> None:
    """SIGTERM mid-generation: /readyz turns 503 at once and new sessions are refused (1013), the
    running generation finishes with exactly the target's tokens, its session is closed with 1001,
    and the process exits 0 (it used to close every session with 1012 within 0.3 s)."""
    prompt = prompt_tokens(11)
    with verifier_process("--drain-timeout", "60", "--log-format", "json", "--log-level", "info") as (
        proc,
        port,
    ):
        url = f"ws://127.0.0.1:{port}/v1/session"

        async def main() -> tuple[list[int], int, Close | None, Close | None]:
            s = await AsyncSession.open(url)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt), Mode.AR, max_new_tokens=150)))
            out: list[int] = []
            ready = 0
            refused = None
            for i in range(10_000):
                v = await s.recv()
                assert isinstance(v, Verdict)
                out.extend(v.tokens.tolist())
                if i == 5:
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.3)
                    async with httpx.AsyncClient() as h:
                        ready = (await h.get(f"http://127.0.0.1:{port}/readyz")).status_code
                    try:
                        late = await AsyncSession.open(url)
                        await asyncio.wait_for(late.ws.recv(), 5)
                    except Exception as exc:
                        refused = getattr(exc, "rcvd", None)
                if v.done:
                    break
                await asyncio.sleep(0.02)  # a generation that outlasts the signal by seconds
            try:
                await asyncio.wait_for(s.ws.recv(), 10)
                closed = None
            except Exception as exc:
                closed = getattr(exc, "rcvd", None)
            return out, ready, refused, closed

        out, ready, refused, closed = asyncio.run(main())
        assert out == reference(tuple(prompt), 150)
        assert ready == 503
        assert refused is not None and refused.code == 1013
        assert closed is not None and closed.code == 1001
        assert proc.wait(30) == 0
        # structured logs: one JSON object a line, the session's events carrying its id
        assert proc.stderr is not None
        events = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        mine = [e for e in events if e.get("session") == 1]
        assert [e["message"] for e in mine[:2]] == ["session welcomed", "generation started"]
        assert any(e["message"] == "generation ended" and e["tokens"] == 150 for e in mine)
        assert any(e["message"].startswith("draining") for e in events)
        # uvicorn's own lines too (its default logging config gave them text handlers of their own)
        assert any(e["logger"].startswith("uvicorn") for e in events)


def test_a_model_that_cannot_load_ends_the_process() -> None:
    """`serve --model no-such-model`: one line on stderr naming the model, exit status 1 (it used
    to stay up, /healthz 200 and /readyz 503 forever)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "cloud_verifier.cli", "serve", "--model", "no-such-model"]
    r = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("cloud-verifier: cannot load model 'no-such-model'"), r.stderr
    assert "Traceback" not in r.stderr


def test_a_client_whose_verifier_dies_gets_a_generation_error() -> None:
    """SIGKILL of the verifier mid-generation, with resuming off: the edge client raises its
    GenerationError (the CLI prints it and exits 1), never the transport's raw exception."""
    from edge_client.client import EdgeClient, GenerationError
    from edge_client.drafters.registry import create_drafter

    drafter = create_drafter("torch", "tiny")
    with verifier_process() as (proc, port):

        async def main() -> None:
            async with EdgeClient(f"ws://127.0.0.1:{port}/v1/session", drafter, resume=False) as c:
                n = 0
                async for _ in c.generate("Tell me a long story.", max_new_tokens=400):
                    n += 1
                    if n == 2:
                        proc.kill()

        with pytest.raises(GenerationError, match="closed"):
            asyncio.run(main())
    drafter.close()
