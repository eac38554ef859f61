"""`cloud-verifier fleet` as a user runs it: a local cluster with two replicas of the tiny model,
`fleet status --json` while a session is open, and SIGTERM ending it with status 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from tests.cloud_verifier.service import prompt_tokens, reference
from tests.fleet.wsclient import greedy_session

CLI = [sys.executable, "-m", "cloud_verifier"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _status() -> dict[str, list[dict[str, object]]]:
    out = subprocess.run([*CLI, "fleet", "status", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc: dict[str, list[dict[str, object]]] = json.loads(out.stdout)
    return doc


@pytest.mark.slow
def test_fleet_serves_reports_and_stops(tmp_path: Path) -> None:
    port = _free_port()
    log = (tmp_path / "fleet.log").open("w+")
    flags = ["--model", "tiny", "--replicas", "2", "--threads", "1", "--no-measure-cost"]
    flags += ["--kv-blocks", "2048", "--max-context", "512", "--max-sessions", "4", "--port", str(port)]
    proc = subprocess.Popen([*CLI, "fleet", *flags], stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        deadline = time.monotonic() + 180
        while "replicas of tiny at" not in Path(log.name).read_text():
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(0.5)
        prompt = prompt_tokens(7)
        out: list[list[int]] = []
        session = threading.Thread(
            target=lambda: out.append(greedy_session(f"ws://127.0.0.1:{port}/v1/session", prompt, 48, 7)[0])
        )
        session.start()
        seen = []
        while session.is_alive():
            seen.append(_status()["replicas"])
        session.join()
        assert out == [reference(tuple(prompt), 48)]
        last = seen[-1] if seen else _status()["replicas"]
        assert len(last) == 2 and {r["state"] for r in last} == {"RUNNING"}
        assert {"node", "pid", "sessions", "queue", "state"} <= set(last[0])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
def test_a_target_that_does_not_load_fails_the_fleet(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.gguf")
    flags = ["--model", missing, "--replicas", "1", "--threads", "1", "--port", str(_free_port())]
    out = subprocess.run([*CLI, "fleet", *flags], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "cloud-verifier fleet: the fleet did not start" in out.stderr
    assert f"cannot load the target model {missing!r}" in out.stderr  # the replica's log line
