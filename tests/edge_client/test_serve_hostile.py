"""Hostile input to `edge-client serve`: a client that leaves mid-answer, a verifier that sends a bad
frame, requests from other sites (Host, Origin, Content-Type), bodies over the limit (declared or
chunked), requests queued behind a running generation, and malformed parameters. Each is refused
with a JSON error naming what was wrong, and the next request still gets exactly the target's
tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from bench.lib.shaper import LinkShape
from edge_client.client import EdgeClient
from edge_client.drafters.registry import create_drafter
from edge_client.serve import create_app
from edge_client.transports import Transport, WebSocketTransport
from tests.cloud_verifier.service import LiveServer, reference, tiny
from tests.edge_client.fake_drafter import FakeDrafter
from tests.edge_client.local_server import served

PROMPT = [5, 6, 7, 8, 5, 6, 7]
LONG = 400  # tokens: ~9 s at SLOW (the tiny target never ends early; it drafts ~9 tokens a round)
SLOW: dict[str, Any] = {"link": LinkShape.rtt(200), "prespec": False}  # a round trip per round
JSON_HEADERS = {"content-type": "application/json"}


def text_of(tokens: list[int]) -> str:
    t = tiny()
    return t.tokenizer.decode([x for x in tokens if x not in t.eos_ids], skip_special=True)


@dataclass
class Edge:
    url: str  # http://127.0.0.1:port
    app: FastAPI
    made: list[EdgeClient]  # every session the endpoint opened

    @property
    def origin(self) -> str:
        return self.url


@contextmanager
def edge_server(verifier: str, config: Any = None, prespec: bool = True, **client: Any) -> Iterator[Edge]:
    """`edge-client serve` on uvicorn (loopback, free port) drafting with the tiny torch drafter."""
    drafter = create_drafter("torch", "tiny")
    made: list[EdgeClient] = []

    def make() -> EdgeClient:
        c = EdgeClient(verifier, drafter, prespec=prespec, **client)
        made.append(c)
        return c

    app = create_app(make) if config is None else create_app(make, config)
    try:
        with served(app) as port:
            yield Edge(f"http://127.0.0.1:{port}", app, made)
    finally:
        drafter.close()


@dataclass
class Stack:
    srv: LiveServer
    edge: Edge


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """A live verifier and the endpoint in front of it over a slow link (so that a long generation
    lasts seconds and can be left mid-answer). Requests speculate (greedy) by default: auto would
    let the tiny target stream, which a round trip does not slow."""
    from edge_client.serve import ServeConfig

    with LiveServer() as srv, edge_server(srv.ws, ServeConfig(mode="greedy"), **SLOW) as edge:
        yield Stack(srv, edge)


def verifier_generating(srv: LiveServer) -> int:
    return sum(1 for s in list(srv.state.sessions) if s.generating)


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def exact_completion(edge: Edge, n: int = 24, timeout: float = 60) -> None:
    """A plain greedy completion answers 200 with exactly the target's tokens."""
    r = httpx.post(
        f"{edge.url}/v1/completions",
        json={"prompt": PROMPT, "temperature": 0, "max_tokens": n},
        timeout=timeout,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text_of(reference(tuple(PROMPT), n))


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["message"]
    return err


def read_first_text(lines: Iterator[str]) -> None:
    """Read up to the first text (the caller keeps `lines`: dropping it would close the stream)."""
    for line in lines:
        if line.startswith("data: ") and ('"text": "' in line or '"content": "' in line):
            doc = json.loads(line[6:])
            ch = doc.get("choices") or [{}]
            if ch[0].get("text") or (ch[0].get("delta") or {}).get("content") or doc.get("tokens"):
                return
    raise AssertionError("the stream ended before any text")


# ------------------------------------------------------------------ a client that leaves
def test_stream_aborted_mid_answer_then_next_request_is_exact(stack: Stack) -> None:
    exact_completion(stack.edge)
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": LONG, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{stack.edge.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        read_first_text(lines)
    # the verifier stops at once (not at its idle timeout), and the next request is exact
    wait_until(lambda: verifier_generating(stack.srv) == 0, 10, "the verifier went on generating")
    exact_completion(stack.edge, timeout=20)
    # a chat stream left the same way
    chat = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": LONG, "stream": True,
            "temperature": 0}  # fmt: skip
    with (
        httpx.Client(timeout=30) as h,
        h.stream("POST", f"{stack.edge.url}/v1/chat/completions", json=chat) as r,
    ):
        lines = r.iter_lines()
        read_first_text(lines)
    exact_completion(stack.edge, timeout=20)


def test_live_page_stream_left_mid_answer_then_next_request_is_exact(stack: Stack) -> None:
    body = {"prompt": "Count to five.", "max_tokens": LONG}
    headers = {**JSON_HEADERS, "origin": stack.edge.origin}
    with (
        httpx.Client(timeout=30) as h,
        h.stream("POST", f"{stack.edge.url}/live", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        read_first_text(lines)
    wait_until(lambda: verifier_generating(stack.srv) == 0, 10, "the verifier went on generating")
    exact_completion(stack.edge, timeout=20)


def test_client_gone_during_a_whole_response_cancels_it_and_models_never_wait(stack: Stack) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": LONG}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{stack.edge.url}/v1/completions", json=body, timeout=1.0)
    # the model list answers at once, whatever runs
    r = httpx.get(f"{stack.edge.url}/v1/models", timeout=2)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    wait_until(lambda: verifier_generating(stack.srv) == 0, 10, "the abandoned generation went on")
    exact_completion(stack.edge, timeout=20)
    assert time.monotonic() - t0 < 20


def test_models_and_healthz_answer_while_a_generation_streams(stack: Stack) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": LONG, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{stack.edge.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        read_first_text(lines)
        for path in ("/v1/models", "/healthz", "/"):
            assert httpx.get(f"{stack.edge.url}{path}", timeout=2).status_code == 200, path
        assert next(x for x in lines if x)  # the stream goes on meanwhile
    exact_completion(stack.edge, timeout=20)


def test_a_request_whose_client_leaves_while_waiting_stops_waiting(stack: Stack) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": LONG, "stream": True}
    gate = stack.edge.app.state.edge
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{stack.edge.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        read_first_text(lines)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{stack.edge.url}/v1/completions", json={"prompt": PROMPT}, timeout=0.5)
        wait_until(lambda: gate.waiting == 0, 5, "the request went on waiting for no one")
        assert next(x for x in lines if x)
    exact_completion(stack.edge, timeout=20)


def test_requests_waiting_for_the_generation_are_bounded() -> None:
    from edge_client.serve import ServeConfig

    cfg = ServeConfig(max_waiting=1, wait_s=1.5, mode="greedy")  # (as `stack`: a round trip a round)
    with LiveServer() as srv, edge_server(srv.ws, cfg, **SLOW) as edge:
        body = {"prompt": PROMPT, "temperature": 0, "max_tokens": LONG, "stream": True}
        waited: list[httpx.Response] = []

        def wait_behind() -> None:
            waited.append(httpx.post(f"{edge.url}/v1/completions", json={"prompt": PROMPT}, timeout=30))

        with httpx.Client(timeout=30) as h, h.stream("POST", f"{edge.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            read_first_text(lines)
            t = threading.Thread(target=wait_behind)
            t0 = time.monotonic()
            t.start()
            time.sleep(0.4)  # it waits; one more is one too many
            err = error_of(httpx.post(f"{edge.url}/v1/completions", json={"prompt": PROMPT}, timeout=5), 429)
            assert "wait" in err["message"]
            t.join(30)
            err = error_of(waited[0], 503)
            assert "1.5 s" in err["message"]
            assert 1.4 < time.monotonic() - t0 < 10
            assert next(x for x in lines if x)  # the stream went on meanwhile
        exact_completion(edge, timeout=20)


# ------------------------------------------------------------------ a verifier that misbehaves
class Corrupting:
    """A WebSocket transport that replaces the next frame from the verifier with garbage when told."""

    armed = False

    def __init__(self, inner: WebSocketTransport) -> None:
        self.inner = inner

    async def send(self, data: bytes) -> None:
        await self.inner.send(data)

    async def recv(self) -> bytes:
        data = await self.inner.recv()
        if Corrupting.armed:
            Corrupting.armed = False
            return b"\xc1 not msgpack"
        return data

    async def close(self) -> None:
        await self.inner.close()


def test_a_bad_frame_from_the_verifier_is_a_json_error_and_the_next_request_is_exact() -> None:
    with LiveServer() as srv:

        async def transport() -> Transport:
            return Corrupting(await WebSocketTransport.connect(srv.ws))

        with edge_server(srv.ws, transport=transport) as edge:
            exact_completion(edge)
            Corrupting.armed = True
            body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 24, "stream": True}
            r = httpx.post(f"{edge.url}/v1/completions", json=body, timeout=30)
            events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            assert events and "error" in events[-1], r.text
            exact_completion(edge)
            Corrupting.armed = True
            err = error_of(httpx.post(f"{edge.url}/v1/completions", json={**body, "stream": False}), 502)
            assert "protocol" in err["message"]
            exact_completion(edge)


class Failing(Corrupting):
    """A transport that fails in a way no one planned for (not a GenerationError) when told."""

    async def recv(self) -> bytes:
        data = await self.inner.recv()
        if Corrupting.armed:
            Corrupting.armed = False
            raise RuntimeError("a bug below the client")
        return data


def test_an_unexpected_failure_is_a_json_error_and_the_next_request_is_exact() -> None:
    with LiveServer() as srv:

        async def transport() -> Transport:
            return Failing(await WebSocketTransport.connect(srv.ws))

        with edge_server(srv.ws, transport=transport) as edge:
            exact_completion(edge)
            Corrupting.armed = True
            body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 24}
            err = error_of(httpx.post(f"{edge.url}/v1/completions", json=body, timeout=30), 500)
            assert err["code"] == "internal_error"
            exact_completion(edge)
            Corrupting.armed = True
            r = httpx.post(f"{edge.url}/v1/completions", json={**body, "stream": True}, timeout=30)
            events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            assert events[-1]["error"]["code"] == "internal_error", r.text
            exact_completion(edge)


# ------------------------------------------------------------------ requests from other sites
def _unreachable_app(config: Any = None) -> FastAPI:
    """An endpoint whose verifier is unreachable: a request the guards let through answers 502."""
    drafter = FakeDrafter()

    def make() -> EdgeClient:
        return EdgeClient("ws://127.0.0.1:9/v1/session", drafter, resume=False)

    return create_app(make) if config is None else create_app(make, config)


def _call(app: FastAPI, method: str, path: str, **kw: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as h:
            return await h.request(method, path, **kw)

    return asyncio.run(run())


BODY = json.dumps({"prompt": "Hi", "max_tokens": 4})


def test_another_host_is_refused_dns_rebinding() -> None:
    app = _unreachable_app()
    for host in ("evil.example:8080", "evil.example", "127.0.0.1.evil.example:8080", ""):
        for method, path in (("GET", "/v1/models"), ("GET", "/"), ("POST", "/v1/completions")):
            r = _call(app, method, path, headers={**JSON_HEADERS, "host": host}, content=BODY)
            assert error_of(r, 421)["param"] == "Host", (host, path)
    for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST"):
        r = _call(app, "POST", "/v1/completions", headers={**JSON_HEADERS, "host": host}, content=BODY)
        assert error_of(r, 502)["code"] == "verifier_unreachable", host  # let through
    assert _call(app, "GET", "/", headers={"host": "localhost:8080"}).status_code == 200
    from edge_client.serve import ServeConfig

    every = _unreachable_app(ServeConfig(host="0.0.0.0"))
    r = _call(
        every, "POST", "/v1/completions", headers={**JSON_HEADERS, "host": "192.168.1.5:8080"}, content=BODY
    )
    assert error_of(r, 502)["code"] == "verifier_unreachable"
    r = _call(
        every, "POST", "/v1/completions", headers={**JSON_HEADERS, "host": "evil.example"}, content=BODY
    )
    assert error_of(r, 421)["param"] == "Host"


def test_another_origin_is_refused_unless_allowed() -> None:
    app = _unreachable_app()
    for origin in ("http://evil.example", "null", "http://127.0.0.1:3000", "https://127.0.0.1:8080"):
        for method, path in (("POST", "/v1/completions"), ("POST", "/live"), ("GET", "/v1/models")):
            r = _call(app, method, path, headers={**JSON_HEADERS, "origin": origin}, content=BODY)
            assert error_of(r, 403)["param"] == "Origin", (origin, path)
        preflight = {"origin": origin, "access-control-request-method": "POST"}
        assert error_of(_call(app, "OPTIONS", "/v1/completions", headers=preflight), 403)["param"] == "Origin"
    for origin in ("http://127.0.0.1:8080", "http://localhost:8080"):  # the endpoint's own pages
        r = _call(app, "POST", "/v1/completions", headers={**JSON_HEADERS, "origin": origin}, content=BODY)
        assert error_of(r, 502)["code"] == "verifier_unreachable"
        assert "access-control-allow-origin" not in r.headers
    from edge_client.serve import ServeConfig

    with pytest.raises(ValueError, match="origin"):
        ServeConfig(allow_origins=("app.example/path",))
    allowed = _unreachable_app(ServeConfig(allow_origins=("http://app.example:3000",)))
    app_origin = {"origin": "http://app.example:3000"}
    r = _call(allowed, "POST", "/v1/completions", headers={**JSON_HEADERS, **app_origin}, content=BODY)
    assert error_of(r, 502)["code"] == "verifier_unreachable"
    assert r.headers["access-control-allow-origin"] == "http://app.example:3000"
    pre = {
        **app_origin,
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    r = _call(allowed, "OPTIONS", "/v1/completions", headers=pre)
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "http://app.example:3000"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = _call(
        allowed,
        "POST",
        "/v1/completions",
        headers={**JSON_HEADERS, "origin": "http://evil.example"},
        content=BODY,
    )
    assert error_of(r, 403)["param"] == "Origin"


def test_a_body_that_is_not_json_by_content_type_is_refused() -> None:
    app = _unreachable_app()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": ctype} if ctype else {}
        for path in ("/v1/completions", "/v1/chat/completions", "/live"):
            r = _call(app, "POST", path, headers=headers, content=BODY)
            assert error_of(r, 415)["param"] == "Content-Type", (ctype, path)
    r = _call(
        app,
        "POST",
        "/v1/completions",
        headers={"content-type": "application/json; charset=utf-8"},
        content=BODY,
    )
    assert error_of(r, 502)["code"] == "verifier_unreachable"


# ------------------------------------------------------------------ bodies over the limit
def _asgi_post(
    app: FastAPI, headers: list[tuple[bytes, bytes]], chunks: Iterator[bytes]
) -> tuple[int, bytes, int]:
    """POST /v1/completions in-process: (status, body, bytes of the request body the app read)."""
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        chunk = next(chunks, None)
        if chunk is None:
            await asyncio.sleep(3600)  # the client never sends more
        assert chunk is not None
        read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5),
        "headers": [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json"), *headers],
    }  # fmt: skip

    async def run() -> None:
        await asyncio.wait_for(app(scope, receive, send), 30)

    asyncio.run(run())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, read


def _endless(chunk: int = 64 << 10) -> Iterator[bytes]:
    part = b"[" + b" " * (chunk - 1)
    for _ in range((400 << 20) // chunk):  # 400 MB
        yield part


def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    from shared.openai_compat import MAX_BODY_BYTES

    app = _unreachable_app()
    # declared too large: refused with nothing read
    status, body, read = _asgi_post(app, [(b"content-length", str(400 << 20).encode())], _endless())
    assert status == 413 and read == 0
    assert str(MAX_BODY_BYTES) in json.loads(body)["error"]["message"]
    # chunked, no length: read as it comes and no further than the limit plus one chunk
    status, body, read = _asgi_post(app, [(b"transfer-encoding", b"chunked")], _endless())
    assert status == 413, body
    assert MAX_BODY_BYTES < read <= MAX_BODY_BYTES + (64 << 10)
    assert str(MAX_BODY_BYTES) in json.loads(body)["error"]["message"]


def test_a_body_that_never_ends_is_a_408() -> None:
    from edge_client.serve import ServeConfig

    app = _unreachable_app(ServeConfig(body_timeout_s=0.3))
    t0 = time.monotonic()
    status, body, read = _asgi_post(app, [(b"transfer-encoding", b"chunked")], iter([b'{"prompt": "Hi"']))
    assert status == 408 and read == 15 and time.monotonic() - t0 < 5
    assert "0.3 s" in json.loads(body)["error"]["message"]


def test_a_chunked_body_over_the_limit_on_the_wire_is_answered_early() -> None:
    """A real socket: the server answers 413 and closes while the client is still sending, having
    taken at most the limit plus what the kernel buffers (not the 400 MB the client offers)."""
    from shared.openai_compat import MAX_BODY_BYTES

    drafter = FakeDrafter()
    app = create_app(lambda: EdgeClient("ws://127.0.0.1:9/v1/session", drafter))
    with served(app) as port:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
        sent, answer = 0, b""
        s.setblocking(False)
        cap = 400 << 20
        deadline = time.monotonic() + 60
        while sent < cap and time.monotonic() < deadline:
            readable, writable, _ = select.select([s], [s], [], 1.0)
            if readable:
                break
            if writable:
                try:
                    sent += s.send(chunk)  # a partial chunk is fine: the server stops reading anyway
                except (BlockingIOError, ConnectionError):
                    break
        s.setblocking(True)
        s.settimeout(10)
        with contextlib.suppress(ConnectionError):
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                data = s.recv(65536)
                if not data:
                    break
                answer += data
        s.close()
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert str(MAX_BODY_BYTES).encode() in answer
        assert sent < MAX_BODY_BYTES + (64 << 20), sent  # the limit plus socket buffers, not 400 MB


# ------------------------------------------------------------------ malformed parameters
def _post(stack: Stack, path: str, raw: str) -> httpx.Response:
    return httpx.post(f"{stack.edge.url}{path}", content=raw.encode(), headers=JSON_HEADERS, timeout=30)


def _refused(stack: Stack, cases: list[tuple[str, str, str]]) -> None:
    """Each (path, raw body, parameter) is a 400 JSON error naming the parameter; nothing is lost."""
    wrong = []
    for path, raw, param in cases:
        r = _post(stack, path, raw)
        ok = r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        if not ok or r.json()["error"]["param"] != param:
            wrong.append((path, raw[:60], param, r.status_code, r.text[:160]))
    assert not wrong, wrong
    exact_completion(stack.edge)


def test_a_lone_surrogate_an_empty_prompt_and_a_bad_mode_are_400s_naming_them(stack: Stack) -> None:
    _refused(
        stack,
        [
            ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
            ("/v1/completions", '{"prompt": ["a\\ud800b"]}', "prompt"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages"),
            ("/live", '{"prompt": "a\\ud800b"}', "prompt"),
            ("/v1/completions", '{"prompt": ""}', "prompt"),
            ("/v1/completions", '{"prompt": []}', "prompt"),
            ("/v1/completions", '{"prompt": [""]}', "prompt"),
            ("/v1/chat/completions", '{"messages": []}', "messages"),
            ("/live", '{"prompt": ""}', "prompt"),
            ("/v1/completions", '{"prompt": "Hi", "mode": []}', "mode"),
        ],
    )


def test_numbers_too_large_and_unsupported_parameters_are_400s_naming_them(stack: Stack) -> None:
    """The shared parser's rules (shared.openai_compat) hold on the edge too."""
    huge = "9" * 400
    hi = '[{"role": "user", "content": "Hi"}]'
    _refused(
        stack,
        [
            ("/v1/completions", f'{{"prompt": "Hi", "temperature": {huge}}}', "temperature"),
            ("/v1/completions", f'{{"prompt": "Hi", "top_p": {huge}}}', "top_p"),
            ("/v1/chat/completions", f'{{"messages": {hi}, "temperature": {huge}}}', "temperature"),
            ("/v1/completions", '{"prompt": "Hi", "repetition_penalty": 1.3}', "repetition_penalty"),
            ("/v1/completions", '{"prompt": "Hi", "min_tokens": 5}', "min_tokens"),
            ("/v1/chat/completions", f'{{"messages": {hi}, "tool_choice": "auto"}}', "tool_choice"),
        ],
    )


def test_json_nested_100k_deep_is_a_400(stack: Stack) -> None:
    deep = 100_000
    for path, raw in (
        ("/v1/completions", "[" * deep + "]" * deep),
        ("/v1/completions", '{"prompt": ' + "[" * deep + "]" * deep + "}"),
        ("/v1/chat/completions", '{"messages": ' + '{"a": ' * deep + "1" + "}" * deep + "}"),
        ("/live", '{"prompt": ' + "[" * deep + "]" * deep + "}"),
    ):
        err = error_of(_post(stack, path, raw), 400)
        assert "JSON" in err["message"], err
    exact_completion(stack.edge)


def test_serve_cli_takes_allowed_origins_and_refuses_a_malformed_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from edge_client import cli

    assert (
        cli.main(["serve", "--allow-origin", "http://localhost:3000", "--allow-origin", "app.example/x"]) == 2
    )
    assert "--allow-origin" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--allow-origin" in help_text and "Host" in help_text and "Origin" in help_text
