"""The verifier's lifecycle, health and keys under hostile conditions: a key file with '#' in a
key, reloaded on SIGHUP; missing files on the command line; the API docs behind the key; a burst
after idling; SIGTERM with HTTP streams in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cloud_verifier.auth import AuthError, KeyStore
from cloud_verifier.engine import Engine
from cloud_verifier.step import RoundResult
from shared.messages import Error, Mode, Prompt, Welcome
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    prompt_tokens,
    reference,
    service,
    tiny,
)
from tests.cloud_verifier.test_lifecycle import verifier_process


# ------------------------------------------------------------------------------- the key file
def test_a_hash_inside_a_key_is_part_of_it(tmp_path: Path) -> None:
    """'#' starts a comment only as the first character of a word; it used to cut every line at its
    first '#', so the key 'k-7b#e2' became 'k-7b' (and 'k-7b' was let in)."""
    f = tmp_path / "keys"
    f.write_text("# a comment line\n  # an indented one\nk-7b#e2 trusted  # the rest is a comment\nk-9#\n")
    keys = KeyStore.from_file(str(f))
    assert keys.authenticate("k-7b#e2").trusted
    assert not keys.authenticate("k-9#").trusted
    for wrong in ("k-7b", "k-9", "#", "the"):
        with pytest.raises(AuthError, match="unknown API key"):
            keys.authenticate(wrong)


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("k-1 trusted\nk-2\nk-1\n")
    with pytest.raises(ValueError, match=r"keys:3: this key is already on line 1"):
        KeyStore.from_file(str(f))


def test_reload_swaps_the_keys_and_a_bad_file_keeps_them(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("k-old\nk-stay sessions=2\n")
    keys = KeyStore.from_file(str(f))
    stay = keys.authenticate("k-stay").name
    f.write_text("k-new trusted\nk-stay sessions=3\n")
    assert keys.reload(str(f)) == 2
    with pytest.raises(AuthError):
        keys.authenticate("k-old")
    assert keys.authenticate("k-new").trusted
    assert keys.authenticate("k-stay").name == stay  # its per-key counts carry on
    assert keys.authenticate("k-stay").max_sessions == 3
    assert keys.authenticate("k-new").name not in (stay, "key#0")  # never a removed key's name
    for bad in ("k-x sessions=lots\n", "# nothing\n"):
        f.write_text(bad)
        with pytest.raises(ValueError, match=r"keys:1|no keys"):
            keys.reload(str(f))
        assert keys.authenticate("k-new").trusted
    f.unlink()
    with pytest.raises(OSError):
        keys.reload(str(f))
    assert keys.authenticate("k-new").trusted


# ------------------------------------------------------------------------ health after idling
def _stall_after(engine: Engine, seconds: float) -> None:
    engine.config = replace(engine.config, stall_s=seconds)


def test_work_after_idling_longer_than_stall_s_is_not_a_stall() -> None:
    """Idle past stall_s, then submit: the engine is healthy at once (it used to measure the wait
    from the last step's end, so the first work after idling read as a stalled loop: /readyz and
    every request 503 until a step began)."""
    with service() as client:
        assert client.portal is not None
        state = client.app.state.verifier  # type: ignore[attr-defined]  # Starlette types app as ASGIApp
        engine: Engine = state.engine
        _stall_after(engine, 0.3)
        time.sleep(0.5)

        async def burst() -> tuple[bool, list[list[int]]]:
            done: asyncio.Queue[tuple[int, RoundResult]] = asyncio.Queue()
            prompts = [prompt_tokens(40 + i) for i in range(4)]

            def on_result(i: int) -> Callable[[RoundResult], None]:
                return lambda r: done.put_nowait((i, r))

            seqs = [engine.open(on_result(i)) for i in range(len(prompts))]
            for seq, p in zip(seqs, prompts, strict=True):
                engine.start(seq, Prompt(np.array(p), Mode.AR, max_new_tokens=3), np.array(p))
            healthy = engine.healthy() and state.ready  # before the loop has run a step
            out: list[list[int]] = [[] for _ in prompts]
            while sum(len(o) for o in out) < 3 * len(prompts):
                i, r = await asyncio.wait_for(done.get(), 30)
                out[i] += r.tokens
                if not r.done:
                    engine.submit(seqs[i], 0, None)
            return healthy, out

        healthy, out = client.portal.call(burst)
        assert healthy
        assert out == [reference(tuple(prompt_tokens(40 + i)), 3) for i in range(4)]


def test_a_burst_of_http_requests_after_idling_gets_no_503() -> None:
    """20 concurrent completions after idling past stall_s: none is refused as not ready and
    /readyz stays 200 (the probe saw 18 of 20 answered 503 after 5 s idle)."""
    with LiveServer(max_sessions=8) as srv:
        _stall_after(srv.engine, 0.3)
        time.sleep(0.5)

        async def main() -> tuple[list[int], list[int]]:
            async with httpx.AsyncClient(timeout=60) as h:

                async def one(i: int) -> int:
                    body = {"prompt": prompt_tokens(60 + i), "max_tokens": 4, "temperature": 0}
                    return (await h.post(srv.http + "/v1/completions", json=body)).status_code

                async def ready() -> list[int]:
                    return [(await h.get(srv.http + "/readyz")).status_code for _ in range(10)]

                codes = asyncio.gather(*(one(i) for i in range(20)))
                return list(await codes), await ready()

        codes, ready = asyncio.run(main())
        assert 503 not in codes and set(codes) <= {200, 429}, codes
        assert set(ready) == {200}, ready


def test_a_loop_that_plans_nothing_while_work_waits_is_still_a_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the rule above: ready work that gets no step for stall_s is a stall."""
    with LiveServer() as srv:
        engine: Engine = srv.engine
        _stall_after(engine, 0.3)
        stuck = {"on": True}
        real = engine.runner.plan

        def plan() -> Any:
            return [] if stuck["on"] else real()

        monkeypatch.setattr(engine.runner, "plan", plan)

        async def main() -> tuple[int, int, int]:
            async with httpx.AsyncClient(timeout=60) as h:
                body = {"prompt": prompt_tokens(70), "max_tokens": 3, "temperature": 0}
                request = asyncio.create_task(h.post(srv.http + "/v1/completions", json=body))
                await asyncio.sleep(0.1)
                early = (await h.get(srv.http + "/readyz")).status_code
                await asyncio.sleep(0.5)
                late = (await h.get(srv.http + "/readyz")).status_code
                stuck["on"] = False
                return early, late, (await request).status_code

        early, late, status = asyncio.run(main())
        assert (early, late, status) == (200, 503, 200)
        assert httpx.get(srv.http + "/readyz").status_code == 200


# ------------------------------------------------------------------- files on the command line
def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cloud_verifier.cli", "serve", "--model", "tiny", "--port", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_missing_or_broken_files_end_the_start_in_one_line(tmp_path: Path) -> None:
    """Each: exit status 2 and one line on stderr naming the flag (or variable), the path and
    why; no traceback (a missing key file or certificate used to end in one)."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    bad_keys = tmp_path / "keys"
    bad_keys.write_text("k-1 sessions=many\n")
    cases: list[tuple[list[str], dict[str, str], str]] = [
        (["--api-key-file", "/nope/keys"], {}, "--api-key-file /nope/keys: No such file or directory"),
        (["--api-key-file", str(tmp_path)], {}, f"--api-key-file {tmp_path}: Is a directory"),
        (["--api-key-file", str(bad_keys)], {}, f"--api-key-file: {bad_keys}:1: expected"),
        (
            ["--ssl-certfile", "/nope/cert.pem", "--ssl-keyfile", str(garbage)],
            {},
            "--ssl-certfile /nope/cert.pem: No such file or directory",
        ),
        (
            ["--ssl-certfile", str(garbage), "--ssl-keyfile", "/nope/key.pem"],
            {},
            "--ssl-keyfile /nope/key.pem: No such file or directory",
        ),
        (
            ["--ssl-certfile", str(garbage), "--ssl-keyfile", str(garbage)],
            {},
            f"--ssl-certfile {garbage} / --ssl-keyfile {garbage}: not a PEM certificate chain",
        ),
        ([], {"CLOUD_VERIFIER_API_KEY_FILE": "/nope/keys"}, "--api-key-file /nope/keys: No such file"),
        ([], {"CLOUD_VERIFIER_PORT": "eighty"}, "CLOUD_VERIFIER_PORT='eighty': 'eighty' is not an integer"),
        ([], {"CLOUD_VERIFIER_TRUST_ANONYMOUS": "maybe"}, "CLOUD_VERIFIER_TRUST_ANONYMOUS='maybe': expected"),
    ]
    for args, env, line in cases:
        r = _serve(*args, env=env)
        assert r.returncode == 2, (args, env, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"cloud-verifier: {line}"), r.stderr
    r = _serve("--port", "70000")  # it used to start, listening on no port it was given
    assert r.returncode == 2 and "argument --port: 70000 is out of range" in r.stderr, r.stderr


# ------------------------------------------------------------------------- the docs and keys
def test_with_keys_every_http_route_but_the_probes_needs_one(tmp_path: Path) -> None:
    """FastAPI's /docs, /redoc and /openapi.json (and unknown paths) answered anyone although a key
    file was configured; now 401 in OpenAI's error body. /healthz, /readyz and /metrics stay open."""
    f = tmp_path / "keys"
    f.write_text("k-1\n")
    key = {"Authorization": "Bearer k-1"}
    with service(api_key_file=str(f)) as client:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/v1/models", "/nope"):
            r = client.get(path)
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key" and "needs an API key" in r.text
            r = client.get(path, headers={"Authorization": "Bearer k-2"})
            assert r.status_code == 401 and "unknown API key" in r.text, path
        r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
        assert r.status_code == 401
        for path in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
            assert client.get(path, headers=key).status_code == 200, path
        assert client.get("/nope", headers=key).status_code == 404
        for path in ("/healthz", "/readyz", "/metrics"):
            assert client.get(path).status_code == 200, path
    with service() as client:  # no key file: open access, the docs included
        assert client.get("/docs").status_code == 200


# ------------------------------------------------------------------- draining HTTP generations
@pytest.fixture
def slow_steps(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """Each engine forward takes at least `delay` seconds longer (a long generation on a tiny model)."""
    model = tiny().model
    real = model.forward_packed
    slow = {"delay": 0.0}

    def forward_packed(inputs: Any, kv: Any) -> Any:
        time.sleep(slow["delay"])
        return real(inputs, kv)

    monkeypatch.setattr(model, "forward_packed", forward_packed)
    return slow


async def _events(h: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[str]:
    async with h.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                yield line[6:]


def _token_ids(events: list[str]) -> list[int]:
    return [
        t
        for e in events
        if e.startswith("{")
        for c in json.loads(e).get("choices", [])
        for t in c["token_ids"]
    ]


def test_a_drain_waits_for_http_streams_and_refuses_new_requests(slow_steps: dict[str, float]) -> None:
    """SIGTERM's drain with an HTTP stream running: the stream runs to its end ([DONE], finish
    reason, exactly the target's tokens) although it outlasts uvicorn's 5 s of grace; meanwhile
    new requests get 503 naming the drain, /readyz 503, /healthz 200; then the server stops. The
    drain used to wait for WebSocket sessions only: the stream was cut ~5 s later with no end."""
    prompt = prompt_tokens(80)
    n = 70
    with LiveServer(drain_timeout_s=60) as srv:
        slow_steps["delay"] = 0.1  # ~7 s of generation

        async def main() -> tuple[list[str], list[int], float]:
            events: list[str] = []
            seen: list[int] = []
            async with httpx.AsyncClient(timeout=60) as h:
                body = {
                    "prompt": prompt,
                    "max_tokens": n,
                    "temperature": 0,
                    "stream": True,
                    "return_token_ids": True,
                }
                async for e in _events(h, srv.http + "/v1/completions", body):
                    events.append(e)
                    if len(events) == 3:
                        srv.drain()
                        t0 = time.monotonic()
                        await asyncio.sleep(0.2)
                        r = await h.post(
                            srv.http + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}
                        )
                        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
                        assert "draining" in r.json()["error"]["message"]
                        seen += [(await h.get(srv.http + p)).status_code for p in ("/readyz", "/healthz")]
            return events, seen, time.monotonic() - t0

        events, seen, after = asyncio.run(main())
        slow_steps["delay"] = 0.0  # the reference decodes with the same model
        assert seen == [503, 200]
        assert after > 5.5, after  # the stream outlasted uvicorn's own grace period
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert _token_ids(events) == reference(tuple(prompt), n)
        srv.thread.join(30)
        assert not srv.thread.is_alive()


def test_http_requests_still_running_at_the_drain_timeout_end_with_an_error(
    slow_steps: dict[str, float],
) -> None:
    """At the drain's deadline a stream ends with an error event naming the shutdown, then
    [DONE] (its tokens so far the target's); a request whose response has not begun gets 503."""
    prompt = prompt_tokens(81)
    with LiveServer(drain_timeout_s=1.0) as srv:
        slow_steps["delay"] = 0.05

        async def main() -> tuple[list[str], httpx.Response]:
            events: list[str] = []
            async with httpx.AsyncClient(timeout=60) as h:
                whole = asyncio.create_task(
                    h.post(
                        srv.http + "/v1/completions",
                        json={"prompt": prompt, "max_tokens": 500, "temperature": 0},
                    )
                )
                body = {
                    "prompt": prompt,
                    "max_tokens": 500,
                    "temperature": 0,
                    "stream": True,
                    "return_token_ids": True,
                }
                async with asyncio.timeout(30):
                    async for e in _events(h, srv.http + "/v1/completions", body):
                        events.append(e)
                        if len(events) == 2:
                            srv.drain()
                return events, await whole

        events, whole = asyncio.run(main())
        slow_steps["delay"] = 0.0
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "shutting_down" and "within the 1 s drain" in err["message"], err
        ids = _token_ids(events[:-2])
        assert 0 < len(ids) < 500 and ids == reference(tuple(prompt), len(ids))
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "shutting_down", whole.text
        srv.thread.join(30)
        assert not srv.thread.is_alive()


# ---------------------------------------------------------------------------------- SIGHUP
def test_sighup_reloads_the_key_file_and_sigterm_drains_an_http_stream(tmp_path: Path) -> None:
    """SIGHUP used to end the process (no drain); now it reloads the key file: keys added work
    and keys removed are refused for new requests and sessions, a bad file keeps the keys in use
    and logs one line. Then SIGTERM with an HTTP stream running: it ends with [DONE], exit 0."""
    f = tmp_path / "keys"
    f.write_text("k-old\n")
    with verifier_process("--api-key-file", str(f), "--log-level", "info") as (proc, port):
        base = f"http://127.0.0.1:{port}"

        def status(key: str) -> int:
            return httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

        async def hello(key: str) -> object:
            s = await AsyncSession.open(f"ws://127.0.0.1:{port}/v1/session", api_key=key)
            msg = await asyncio.wait_for(s.recv(), 10)
            await s.close()
            return msg

        assert (status("k-old"), status("k-new")) == (200, 401)
        f.write_text("k-new trusted  # added\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while status("k-new") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "SIGHUP did not reload the keys"
            time.sleep(0.05)
        assert status("k-old") == 401
        assert isinstance(asyncio.run(hello("k-new")), Welcome)
        assert isinstance(asyncio.run(hello("k-old")), Error)
        f.write_text("k-bad sessions=lots\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert (status("k-new"), status("k-bad")) == (200, 401)

        async def stream() -> list[str]:
            events: list[str] = []
            body = {"prompt": prompt_tokens(82), "max_tokens": 300, "stream": True, "temperature": 0}
            async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer k-new"}) as h:
                async for e in _events(h, base + "/v1/completions", body):
                    events.append(e)
                    if len(events) == 1:
                        proc.send_signal(signal.SIGTERM)
            return events

        events = asyncio.run(stream())
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        log = proc.stderr.read()
        failed = [line for line in log.splitlines() if "key file was not reloaded" in line]
        assert len(failed) == 1 and f"{f}:1" in failed[0], log[-3000:]
        assert "SIGHUP: reloaded" in log
