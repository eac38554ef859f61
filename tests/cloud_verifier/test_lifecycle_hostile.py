"""The verifier's lifecycle, health and keys under hostile conditions: a key file with '#' in a
key, reloaded on SIGHUP; missing files on the command line; the API docs behind the key; a burst
after idling; SIGTERM with HTTP streams in flight."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cloud_verifier.auth import AuthError, KeyStore
from cloud_verifier.engine import Engine
from cloud_verifier.engine_state import RoundResult
from shared.messages import Mode, Prompt
from tests.cloud_verifier.service import LiveServer, prompt_tokens, reference, service


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
        real = engine._plan

        def plan() -> Any:
            return [] if stuck["on"] else real()

        monkeypatch.setattr(engine, "_plan", plan)

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
        ([], {"CLOUD_VERIFIER_PORT": "eighty"}, "CLOUD_VERIFIER_PORT='eighty': expected an integer"),
        ([], {"CLOUD_VERIFIER_TRUST_ANONYMOUS": "maybe"}, "CLOUD_VERIFIER_TRUST_ANONYMOUS='maybe': expected"),
    ]
    for args, env, line in cases:
        r = _serve(*args, env=env)
        assert r.returncode == 2, (args, env, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"cloud-verifier: {line}"), r.stderr
    r = _serve("--port", "70000")  # it used to start, listening on no port it was given
    assert r.returncode == 2 and "argument --port: 70000 is not a TCP port (0-65535)" in r.stderr, r.stderr
