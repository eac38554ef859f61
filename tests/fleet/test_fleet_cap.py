"""The fleet past its cap, on a local Ray cluster: one replica of the tiny verifier with a cap of one
session. A second session reaches the replica and is refused at once with close 1013, as one
verifier refuses it, while the first goes on and probes still answer; past Serve's cap on the
replica (the session, one connection in handshake) the proxy holds one upgrade and refuses the
next at once (HTTP 500 on a WebSocket, 503 with Retry-After on HTTP). The edge client takes both
for a connection lost (resumable, tried again with backoff)."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import ClientConnection, connect  # noqa: E402

from bench.lib.ray_fleet import LocalFleet  # noqa: E402
from cloud_verifier.fleet.config import FleetArgs  # noqa: E402
from edge_client.errors import ConnectionLost  # noqa: E402
from edge_client.session import Session  # noqa: E402
from shared.messages import Hello  # noqa: E402
from shared.protocol import ClientProtocol  # noqa: E402
from tests.cloud_verifier.service import prompt_tokens, reference, tiny  # noqa: E402
from tests.fleet.wsclient import greedy_session  # noqa: E402

FULL = FleetArgs(
    model="tiny",
    max_sessions_per_replica=1,
    max_queued_requests=1,
    # Serve's cap on the replica: 1 session + 1 connection in handshake + 0 HTTP requests waiting
    overrides={
        "measure_cost": False,
        "max_context": 512,
        "kv_blocks": 2048,
        "threads": 1,
        "max_handshakes": 1,
        "max_waiting": 0,
        "hello_timeout_s": 60.0,
    },
)
PROMPTLY_S = 10.0


@pytest.fixture(scope="module")
def fleet() -> Iterator[str]:
    """The fleet's address: ws://127.0.0.1:PORT."""
    assert FULL.serve_cap() == 2
    with LocalFleet(num_cpus=2) as local:
        local.run(FULL)
        yield local.base


class _Tiny(Session):
    def vocab_fingerprint(self) -> str:
        return tiny().vocab_fingerprint


def _edge_connect(url: str) -> str:
    """What the edge client's connect raises at `url` (it must raise)."""

    async def attempt() -> None:
        session = _Tiny(url, resume=False)
        try:
            await session.connect()
        finally:
            await session.drop_connection()

    with pytest.raises(ConnectionLost) as info:
        asyncio.run(attempt())
    return str(info.value)


def _hello(ws: ClientConnection) -> None:
    ws.send(ClientProtocol().hello(Hello(vocab_fingerprint=tiny().vocab_fingerprint)))


def _http(url: str) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=PROMPTLY_S) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def _holding_a_session(fleet: str, body: Callable[[], None]) -> None:
    """Run `body` while a session holds the replica's one slot; then that session generates its
    tokens to the end (the reference's)."""
    welcomed, go = threading.Event(), threading.Event()
    prompt = prompt_tokens(11)
    out: list[list[int]] = []

    def hold() -> None:
        welcomed.set()
        go.wait(120)

    first = threading.Thread(
        target=lambda: out.append(greedy_session(f"{fleet}/v1/session", prompt, 32, 11, on_welcome=hold)[0])
    )
    first.start()
    try:
        assert welcomed.wait(120), "the first session was not welcomed"
        body()
    finally:
        go.set()
        first.join(120)
    assert out == [reference(tuple(prompt), 32)]


@pytest.mark.slow
def test_a_session_past_the_cap_is_refused_with_1013_while_the_first_goes_on(fleet: str) -> None:
    http = fleet.replace("ws://", "http://")

    def refused() -> None:
        t0 = time.monotonic()
        with connect(f"{fleet}/v1/session", open_timeout=PROMPTLY_S) as ws:
            _hello(ws)
            with pytest.raises(ConnectionClosed) as info:
                ws.recv(PROMPTLY_S)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1013, info.value
        assert "try again later" in info.value.rcvd.reason
        assert time.monotonic() - t0 < PROMPTLY_S
        assert "(1013)" in _edge_connect(f"{fleet}/v1/session")
        # the replica, not Serve's queue, answers: probes and scrapes are not held behind sessions
        assert _http(f"{http}/healthz")[0] == 200
        assert _http(f"{http}/metrics")[0] == 200

    _holding_a_session(fleet, refused)


@pytest.mark.slow
def test_past_serves_cap_the_proxy_holds_one_upgrade_and_refuses_the_next(fleet: str) -> None:
    http = fleet.replace("ws://", "http://")

    def overflow() -> None:
        handshake = connect(f"{fleet}/v1/session", open_timeout=PROMPTLY_S)  # Serve's cap (2) reached
        queued: list[object] = []

        def wait_in_the_proxy() -> None:
            try:
                with connect(f"{fleet}/v1/session", open_timeout=60) as ws:
                    queued.append("open")
                    _hello(ws)
                    ws.recv(PROMPTLY_S)
            except ConnectionClosed as exc:
                queued.append(exc.rcvd.code if exc.rcvd is not None else None)
            except Exception as exc:
                queued.append(exc)

        waiting = threading.Thread(target=wait_in_the_proxy)
        try:
            waiting.start()
            time.sleep(2.0)
            assert queued == []  # held in the proxy's queue (max_queued_requests 1)
            t0 = time.monotonic()
            with pytest.raises(InvalidStatus) as info:
                connect(f"{fleet}/v1/session", open_timeout=PROMPTLY_S).close()
            assert info.value.response.status_code == 500  # Serve's 503, on a WebSocket scope
            assert time.monotonic() - t0 < PROMPTLY_S
            assert "HTTP 500" in _edge_connect(f"{fleet}/v1/session")
            status, headers = _http(f"{http}/healthz")
            assert (status, headers.get("retry-after")) == (503, "1")
        finally:
            handshake.close()  # room on the replica: the queued upgrade goes through, then 1013
            waiting.join(60)
        assert queued == ["open", 1013]

    _holding_a_session(fleet, overflow)
