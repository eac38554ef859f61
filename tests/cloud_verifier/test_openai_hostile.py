"""Hostile clients of the verifier's OpenAI API: a client that leaves frees its slot and
KV cache at once, a huge prompt never freezes the event loop, a key's tokens_per_min bounds what
its requests cost (prompt included, reserved at admission), client mistakes are 400s naming the
parameter, and an honest session running beside all this still gets exactly the target's tokens."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import random
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cloud_verifier import openai_api
from cloud_verifier.admission import Admission, AdmissionRefused
from cloud_verifier.auth import Principal
from cloud_verifier.openai_api import PromptBound, TextStream
from shared.errors import ErrorCode
from shared.messages import Error, Message, Mode, Prompt, Verdict, Welcome
from shared.openai_compat import parse_json_body
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    prompt_tokens,
    reference,
    run_greedy_async,
    tiny,
)

ANY = Principal("anonymous", False)


# ------------------------------------------------------------------------------ admission, no model
def test_a_waiter_cancelled_as_its_slot_arrives_holds_nothing() -> None:
    """A request whose client leaves while it waits in the queue is cancelled; if the slot was handed
    to it in that very moment, it passes on (asyncio.wait_for used to swallow the cancel and return
    a ticket that nobody would release)."""

    async def main() -> None:
        adm = Admission(capacity=1, max_waiting=2, wait_s=5)
        held = adm.try_acquire(ANY)
        waiter = asyncio.create_task(adm.acquire(ANY))
        await asyncio.sleep(0.01)
        assert adm.waiting == 1
        adm.release(held)  # the slot is handed to the waiter...
        waiter.cancel()  # ...whose client leaves before it runs
        await asyncio.wait({waiter})
        assert waiter.cancelled()
        assert (adm.in_use, adm.waiting) == (0, 0)
        # cancelled while it still waits: it leaves the queue, and a later slot goes to no one
        held = adm.try_acquire(ANY)
        waiter = asyncio.create_task(adm.acquire(ANY))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.wait({waiter})
        assert adm.waiting == 0
        adm.release(held)
        assert adm.in_use == 0

    asyncio.run(main())


def test_a_generation_reserves_its_cost_and_gets_back_what_it_did_not_use() -> None:
    who = Principal("key#0", False, tokens_per_min=100)

    async def main() -> None:
        adm = Admission(capacity=8, max_waiting=0, wait_s=0)
        first = await adm.acquire(who, 95)  # prompt + max_tokens
        with pytest.raises(AdmissionRefused, match="tokens per minute") as exc:
            await adm.acquire(who, 10)  # 5 left: wait until 5 more have refilled (~3 s)
        assert 3 <= exc.value.retry_after_s <= 4
        adm.refund(who, 90)  # it stopped after 5 tokens
        adm.release(first)
        second = await adm.acquire(who, 90)
        adm.release(second)
        adm.refund(who, 1000)  # a refund never fills the bucket past one minute's worth
        await adm.acquire(who, 100)
        with pytest.raises(AdmissionRefused):
            await adm.acquire(who, 1)

    asyncio.run(main())


def test_the_prompt_bound_never_counts_more_tokens_than_the_tokenizer() -> None:
    """PromptBound refuses a prompt that cannot fit the context without tokenizing it, so it must
    never claim more tokens than the text really has (else a prompt that fits would be refused)."""
    t = tiny()
    bound = PromptBound.of(t.tokenizer.tokenizer)
    assert bound is not None and bound.bytes_per_token >= 16
    samples = [
        "hello world " * 50,
        " " * 4000,
        "=" * 3000,
        "\x04" * 2000 + "Hi",  # bytes the vocabulary cannot spell: dropped by the tokenizer
        "<|im_start|>" * 100,
        "1234567890" * 100,
        "\U00040000\u00e9\u4e2d\u6587" * 200,
        "".join(chr(c) for c in range(1, 0x800)),
        "\n\t\r" * 500,
    ]
    for text in samples:
        n = len(t.tokenizer.encode(text))
        assert bound.min_tokens(text) <= n, (text[:20], bound.min_tokens(text), n)


# ------------------------------------------------------------------------------ a live verifier
def _post_raw(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(head.encode() + data)
    return s


def _reset(s: socket.socket) -> None:
    """Leave as the probe did: a TCP reset, no answer read."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.01)
    return time.monotonic() - t0


def _idle(srv: LiveServer) -> bool:
    adm, engine = srv.state.admission, srv.engine
    return adm.in_use == 0 and adm.waiting == 0 and not engine.seqs and engine.kv.blocks_in_use == 0


def _generating(srv: LiveServer, n: int) -> Callable[[], bool]:
    def cond() -> bool:
        seqs = list(srv.engine.seqs.values())
        return len(seqs) == n and all(len(s.committed) > s.prompt_len + 10 for s in seqs)

    return cond


HI = [{"role": "user", "content": "Hi"}]
LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0}  # ~10 s of `tiny`


def test_a_client_that_leaves_frees_its_generation_slot_and_kv() -> None:
    """Reset connections used to leave their generations running to max_tokens (a slot and KV
    each); now the slot, the engine sequence and its KV blocks are freed within moments, for a
    whole answer being collected, a stream, and a request still waiting in the queue."""
    with LiveServer(max_context=4096, max_sessions=1, max_waiting=4) as srv:
        for stream in (False, True):
            s = _post_raw(srv.port, "/v1/completions", {**LONG, "stream": stream})
            _until(_generating(srv, 1), 20, "the generation did not start")
            _reset(s)
            took = _until(
                lambda: _idle(srv), 3, f"stream={stream}: the generation went on after its client left"
            )
            print(f"stream={stream}: freed {took:.2f} s after the reset")
        # one generation holds the only slot; a second request waits for it, then leaves
        holder = _post_raw(srv.port, "/v1/completions", {**LONG, "stream": True})
        _until(_generating(srv, 1), 20, "the generation did not start")
        waiter = _post_raw(
            srv.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
        )
        _until(lambda: srv.state.admission.waiting == 1, 5, "the second request did not queue")
        _reset(waiter)
        _until(lambda: srv.state.admission.waiting == 0, 2, "a request whose client left stayed queued")
        _reset(holder)
        _until(lambda: _idle(srv), 3, "the slot was not freed")
        r = httpx.post(srv.http + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_leaves_mid_body_is_no_server_error() -> None:
    """Starlette's ClientDisconnect escaped the route: an "Exception in ASGI application" traceback
    in the log per client that left halfway through its body."""
    handler = _Records()
    records = handler.records
    uvicorn_log = logging.getLogger("uvicorn.error")
    with LiveServer() as srv:
        uvicorn_log.addHandler(handler)
        try:
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": '
            )
            time.sleep(0.2)
            _reset(s)
            time.sleep(0.3)
        finally:
            uvicorn_log.removeHandler(handler)
        assert not [r.getMessage() for r in records if r.levelno >= logging.ERROR]
        assert httpx.get(srv.http + "/readyz").status_code == 200


def _on_the_event_loop() -> bool:
    """Whether the calling thread is running an event loop (the server's, in these tests)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_a_huge_prompt_never_freezes_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ~3 MB prompt was tokenized on the event loop before the context check (/healthz froze 6.9 s,
    19.3 s for four). Now a text that cannot fit is refused without being tokenized (400 naming the
    field and the context); a large body is parsed, and a prompt the bound cannot refuse is
    tokenized, on a worker, and then it runs, exactly.

    Checked where the work runs, not how long /healthz took: each large parse and each tokenization
    asks /healthz while it works and must get the answer, which a loop busy with that very work
    could never give (the check is then recorded instead of asked, so a regression fails at once).
    A bound on /healthz's latency measured the machine instead: parsing JSON holds the GIL, and on a
    2-core machine shared with other work a few tenths of a second of parsing stretched past 1.5 s
    with nothing wrong in the service."""
    big = "hello world " * 250_000  # 3 MB, 500k tokens
    # 3.6 MB of JSON (each \x04 is written \u0004) that the tokenizer drops: one token, it fits
    droppable = "\x04" * 600_000 + "Hello"
    tokenized: list[int] = []  # the length of every text tokenized
    answered: list[str] = []  # the steps during which the loop answered /healthz
    on_loop: list[str] = []  # the steps that ran on the event loop
    encode = openai_api._encode
    with LiveServer() as srv:

        def loop_answers(step: str) -> None:
            if _on_the_event_loop():
                on_loop.append(step)
            elif httpx.get(srv.http + "/healthz", timeout=60).status_code == 200:
                answered.append(step)

        def tokenize(target: Any, text: str, add_special: bool) -> list[int]:
            tokenized.append(len(text))
            loop_answers("tokenize")
            return encode(target, text, add_special)

        def parse_body(raw: bytes) -> dict[str, Any]:
            if len(raw) > openai_api.INLINE_JSON_BYTES:  # a small body is parsed on the loop (< 1 ms)
                loop_answers("parse")
            return parse_json_body(raw)

        monkeypatch.setattr(openai_api, "_encode", tokenize)
        monkeypatch.setattr(openai_api, "parse_json_body", parse_body)

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.http, timeout=120) as h:
                posts = [h.post("/v1/completions", json={"prompt": big, "max_tokens": 4}) for _ in range(3)]
                posts.append(
                    h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]})
                )
                posts.append(
                    h.post(
                        "/v1/completions",
                        json={
                            "prompt": droppable,
                            "max_tokens": 8,
                            "temperature": 0,
                            "return_token_ids": True,
                        },
                    )
                )
                return list(await asyncio.gather(*posts))

        replies = asyncio.run(main())
    for r, param in zip(replies[:4], ["prompt"] * 3 + ["messages"], strict=True):
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, r.text
        assert err["code"] == "context_length_exceeded" and "512" in err["message"], err
    ok = replies[4]
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["token_ids"] == reference(tuple(tiny().tokenizer.encode("Hello")), 8)
    assert tokenized == [len(droppable)]  # the texts that cannot fit were never tokenized
    assert on_loop == []
    assert sorted(answered) == ["parse"] * 5 + ["tokenize"]  # every large body, and the prompt


def test_tokens_per_min_counts_the_prompt_and_reserves_max_tokens(tmp_path: Path) -> None:
    """A 60-token-a-minute key had 90 requests of 4,000-token prompts prefilled in 30 s and ran 8
    at once: only generated tokens counted, and only at admission. Now the prompt and max_tokens
    are reserved when a request is admitted: one that can never fit the key's minute is a 400
    naming what to shorten, and concurrent ones beyond the budget get 429 with Retry-After."""
    keys = tmp_path / "keys"
    keys.write_text("k-60 tokens_per_min=60\n")
    auth = {"authorization": "Bearer k-60"}
    with LiveServer(api_key_file=str(keys), max_sessions=16) as srv:

        async def main() -> tuple[list[httpx.Response], list[httpx.Response]]:
            async with httpx.AsyncClient(base_url=srv.http, headers=auth, timeout=60) as h:
                alone = [
                    await h.post("/v1/completions", json={"prompt": prompt_tokens(1, 100), "max_tokens": 1}),
                    await h.post("/v1/completions", json={"prompt": prompt_tokens(2, 5), "max_tokens": 100}),
                    await h.post(
                        "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 200},
                    ),
                ]
                body = {"prompt": prompt_tokens(3, 10), "max_tokens": 10, "temperature": 0}
                together = await asyncio.gather(*(h.post("/v1/completions", json=body) for _ in range(8)))
                return alone, list(together)

        alone, together = asyncio.run(main())
        for r, param in zip(alone, ["prompt", "max_tokens", "max_completion_tokens"], strict=True):
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and err["code"] == "request_too_large", (
                r.text
            )
            assert "60 tokens per minute" in err["message"]
        codes = sorted(r.status_code for r in together)
        assert codes.count(200) == 3 and codes.count(429) == 5, codes  # 3 x (10 + 10) = 60
        for r in together:
            if r.status_code == 429:
                assert (
                    int(r.headers["retry-after"]) >= 1 and "tokens per minute" in r.json()["error"]["message"]
                )
    # a default max_tokens is what the key may spend: a chat answer of at most 60 - prompt tokens
    keys.write_text("k-60 tokens_per_min=60\n")
    with LiveServer(api_key_file=str(keys)) as srv:
        msgs = [{"role": "user", "content": "Hi"}]
        r = httpx.post(srv.http + "/v1/chat/completions", json={"messages": msgs}, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        use = r.json()["usage"]
        assert use["total_tokens"] <= 60 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_websocket_prompt_counts_against_tokens_per_min(tmp_path: Path) -> None:
    """A session's prompt (its prefill) is charged to its key as its output is: 25 prompt tokens
    (+ 1 new) on a 30-a-minute key leave too little for the next generation (only output counted
    before)."""
    keys = tmp_path / "keys"
    keys.write_text("k-30 tokens_per_min=30\n")
    with LiveServer(api_key_file=str(keys)) as srv:

        async def main() -> tuple[Message, Message]:
            s = await AsyncSession.open(srv.ws, api_key="k-30")
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(5, 25)), Mode.AR, max_new_tokens=1)))
            first = await s.recv()
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(6, 4)), Mode.AR, max_new_tokens=1)))
            second = await s.recv()
            await s.close()
            return first, second

        first, second = asyncio.run(main())
        assert isinstance(first, Verdict) and first.done
        assert isinstance(second, Error) and second.code == ErrorCode.RATE_LIMITED, second


HI_JSON = json.dumps(HI)
HUGE = "9" * 400
DEEP = 100_000
# (path, raw body, the parameter the 400 names)
BAD_REQUESTS: list[tuple[str, str, str | None]] = [
    ("/v1/completions", '{"prompt": ""}', "prompt"),
    ("/v1/completions", '{"prompt": [""]}', "prompt"),
    ("/v1/completions", '{"prompt": []}', "prompt"),
    ("/v1/completions", f'{{"prompt": "Hi", "temperature": {HUGE}}}', "temperature"),
    ("/v1/completions", f'{{"prompt": "Hi", "top_p": {HUGE}}}', "top_p"),
    ("/v1/chat/completions", f'{{"messages": {HI_JSON}, "temperature": -{HUGE}}}', "temperature"),
    ("/v1/completions", "[" * DEEP + "]" * DEEP, None),
    ("/v1/completions", '{"prompt": ' + "[" * DEEP + "]" * DEEP + "}", None),
    ("/v1/chat/completions", '{"messages": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}", None),
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages"),
    ("/v1/completions", '{"prompt": "Hi", "repetition_penalty": 1.3}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "Hi", "min_tokens": 5}', "min_tokens"),
    ("/v1/chat/completions", f'{{"messages": {HI_JSON}, "tool_choice": "auto"}}', "tool_choice"),
    ("/v1/chat/completions", f'{{"messages": {HI_JSON}, "tools": [{{"type": "function"}}]}}', "tools"),
    ("/v1/completions", '{"prompt": "Hi", "logit_bias": {"5": 10}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "Hi", "n": 2}', "n"),
    ("/v1/completions", '{"prompt": "Hi", "best_of": 3}', "best_of"),
    ("/v1/completions", '{"prompt": "Hi", "presence_penalty": 0.5}', "presence_penalty"),
    ("/v1/completions", '{"prompt": "Hi", "ignore_eos": "yes"}', "ignore_eos"),
    ("/v1/completions", '{"prompt": "Hi", "stop": [1]}', "stop"),
    ("/v1/completions", '{"prompt": "Hi", "stream": "yes"}', "stream"),
    ("/v1/completions", '{"prompt": "Hi", "model": ["tiny"]}', "model"),
    ("/v1/chat/completions", f'{{"messages": {HI_JSON}, "response_format": {{"type": "json_object"}}}}',
     "response_format"),
]  # fmt: skip


def test_client_errors_are_400s_naming_the_parameter_and_hurt_nobody(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each used to be a 500 or silently ignored; an empty prompt reached the engine and failed its
    packed step, so every session batched with it was run again alone. Meanwhile an honest
    WebSocket session and an honest HTTP request get exactly the target's tokens."""
    honest_prompt = prompt_tokens(30, 16)
    http_prompt = prompt_tokens(31, 12)
    with LiveServer() as srv:

        async def honest_ws() -> list[int]:
            s = await AsyncSession.open(srv.ws)
            await s.recv()  # welcome
            out = await run_greedy_async(s, honest_prompt, 60, seed=3, nodes=4)
            await s.close()
            return out

        async def main() -> tuple[list[int], httpx.Response, list[httpx.Response]]:
            ws = asyncio.create_task(honest_ws())
            async with httpx.AsyncClient(base_url=srv.http, timeout=60) as h:
                honest = asyncio.create_task(
                    h.post(
                        "/v1/completions",
                        json={
                            "prompt": http_prompt,
                            "max_tokens": 40,
                            "temperature": 0,
                            "return_token_ids": True,
                        },
                    )
                )
                bad = []
                for path, raw, _ in BAD_REQUESTS:
                    bad.append(await h.post(path, content=raw, headers={"content-type": "application/json"}))
                neutral = {
                    "prompt": "Hi",
                    "max_tokens": 2,
                    "repetition_penalty": 1.0,
                    "n": 1,
                    "presence_penalty": 0,
                    "min_tokens": 0,
                    "tool_choice": "none",
                }
                bad.append(await h.post("/v1/completions", json=neutral))
                return await ws, await honest, bad

        with caplog.at_level(logging.ERROR):
            ws_out, honest, replies = asyncio.run(main())
        wrong = []
        for (path, raw, param), r in zip(BAD_REQUESTS, replies, strict=False):
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            err = body.get("error", {})
            if r.status_code != 400 or err.get("param") != param:
                wrong.append((path, raw[:60], param, r.status_code, r.text[:200]))
            elif param is None and err.get("code") != "invalid_json":
                wrong.append((path, raw[:60], "invalid_json", r.status_code, r.text[:200]))
        assert not wrong, wrong
        assert replies[-1].status_code == 200, replies[-1].text  # neutral values are accepted
        assert ws_out == reference(tuple(honest_prompt), 60)
        assert honest.status_code == 200 and honest.json()["choices"][0]["token_ids"] == reference(
            tuple(http_prompt), 40
        )
        failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert not failed, failed  # no engine step failed, no request raised
        assert httpx.get(srv.http + "/readyz").status_code == 200
        _until(lambda: _idle(srv), 5, "a slot or KV block was left held")


def test_the_text_stream_decodes_each_token_a_bounded_number_of_times() -> None:
    """TextStream decoded the whole output again for every token (quadratic: 1.5 s of the event
    loop for a 4,000-token answer); now a few tokens a step, and the text is the same as decoding
    the whole output at once, multi-byte characters split across tokens included."""
    t = tiny()
    decoded = [0]
    real = t.tokenizer.decode

    def counting(ids: Any, skip_special: bool = False) -> str:
        decoded[0] += len(ids)
        return real(ids, skip_special)

    rng = random.Random(7)
    texts = ["Hello world. Ünïcödé 中文 \U0001f600 tabs\tand\nlines " * 3, "x" * 50]
    for sample in texts:
        ids = t.tokenizer.encode(sample, add_special=False)
        ids += [rng.randrange(100, 49152) for _ in range(2000)]  # bytes split across tokens too
        stream = TextStream(t, [])
        stream.tok = copy.copy(t.tokenizer)
        stream.tok.decode = counting  # type: ignore[method-assign]  # count what it decodes
        decoded[0] = 0
        out = "".join(stream.add([i]) for i in ids) + stream.finish()
        assert decoded[0] <= 8 * len(ids), decoded[0]
        full = real(ids, skip_special=True)
        assert out == full or (full.endswith("\ufffd") and full.startswith(out)), sample


def test_http_requests_in_flight_are_bounded_before_their_bodies_are_read() -> None:
    """Each request may hold a body of up to 4 MiB while it waits for admission: past the slots, the
    queue and a little slack, one more is refused at once (503 with Retry-After), not read; the
    server serves again as soon as they leave."""
    from cloud_verifier.server import max_http_requests

    with LiveServer(max_sessions=1, max_waiting=1) as srv:
        limit = max_http_requests(srv.state.config)
        slow: list[socket.socket] = []
        try:
            for _ in range(limit):  # each stops halfway through its body
                s = socket.create_connection(("127.0.0.1", srv.port))
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 1000\r\n\r\n{"prompt": '
                )
                slow.append(s)
            _until(lambda: srv.state.http_running == limit, 10, "the slow requests to be in flight")
            r = httpx.post(srv.http + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "overloaded"
            assert httpx.get(srv.http + "/healthz").status_code == 200  # probes are not counted
        finally:
            for s in slow:
                _reset(s)
        _until(lambda: srv.state.http_running == 0, 10, "the slow requests to end")
        r = httpx.post(srv.http + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
