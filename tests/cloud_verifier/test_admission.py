"""Admission control and per-key limits: slots, the bounded queue, tokens per minute (no model),
then the same limits through a live verifier (WebSocket 1013 / RATE_LIMITED, HTTP 429 + Retry-After)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
from websockets.frames import Close

from cloud_verifier.admission import Admission, AdmissionRefused
from cloud_verifier.auth import KeyStore, Principal
from shared.errors import ErrorCode
from shared.messages import Error, Message, Mode, Prompt, Verdict, Welcome
from tests.cloud_verifier.service import AsyncSession, LiveServer, prompt_tokens

ANY = Principal("anonymous", False)


def test_slots_and_the_bounded_queue() -> None:
    async def main() -> None:
        adm = Admission(capacity=2, max_waiting=1, wait_s=0.3)
        a, b = adm.try_acquire(ANY), await adm.acquire(ANY)
        with pytest.raises(AdmissionRefused):
            adm.try_acquire(ANY)  # full, and a WebSocket does not wait
        waiter = asyncio.create_task(adm.acquire(ANY))
        await asyncio.sleep(0.01)
        assert adm.waiting == 1
        with pytest.raises(AdmissionRefused, match="already wait"):
            await adm.acquire(ANY)  # the queue is full: refused at once
        adm.release(a)  # the slot passes to the waiter
        c = await waiter
        assert adm.in_use == 2 and adm.waiting == 0
        with pytest.raises(AdmissionRefused, match="within") as exc:
            await adm.acquire(ANY)  # waits 0.3 s, no slot frees
        assert exc.value.retry_after_s >= 1
        adm.release(b)
        adm.release(c)
        assert adm.in_use == 0
        adm.closed = True
        with pytest.raises(AdmissionRefused, match="draining"):
            adm.try_acquire(ANY)

    asyncio.run(main())


def test_per_key_sessions_and_tokens_per_minute(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k-a trusted sessions=1 tokens_per_min=120\nk-b\n")
    store = KeyStore.from_file(str(keys))
    a, b = store.authenticate("k-a"), store.authenticate("k-b")
    assert (a.trusted, a.max_sessions, a.tokens_per_min) == (True, 1, 120)
    assert (b.trusted, b.max_sessions, b.tokens_per_min) == (False, None, None)
    adm = Admission(capacity=10, max_waiting=0, wait_s=0)
    t = adm.try_acquire(a)
    with pytest.raises(AdmissionRefused, match="1 concurrent"):
        adm.try_acquire(a)
    adm.try_acquire(b)  # another key is not limited by it
    adm.release(t)
    adm.spend(a, 150)  # 30 over the bucket: two tokens a second refill it
    with pytest.raises(AdmissionRefused, match="tokens per minute") as exc:
        adm.check_tokens(a)
    assert 15 <= exc.value.retry_after_s <= 17
    for bad in ("k x", "k sessions=0", "k tokens_per_min=abc", "k trusted extra=1"):
        keys.write_text(bad + "\n")
        with pytest.raises(ValueError, match="expected"):
            KeyStore.from_file(str(keys))


def test_limits_through_a_live_verifier(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k-a sessions=1 tokens_per_min=20\n")
    with LiveServer(api_key_file=str(keys), max_sessions=4, max_waiting=0) as srv:

        async def main() -> tuple[Close | None, Message, httpx.Response]:
            s = await AsyncSession.open(srv.ws, api_key="k-a")
            assert isinstance(await s.recv(), Welcome)
            second = await AsyncSession.open(srv.ws, api_key="k-a")
            try:
                await asyncio.wait_for(second.ws.recv(), 5)
                refused = None
            except Exception as exc:
                refused = getattr(exc, "rcvd", None)
            # reserve 18 of the key's 20 tokens a minute (12 prompt + 6 new), then ask again
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(1)), Mode.AR, max_new_tokens=6)))
            while True:
                v = await s.recv()
                assert isinstance(v, Verdict), v
                if v.done:
                    break
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(2)), Mode.AR, max_new_tokens=5)))
            limited = await s.recv()
            async with httpx.AsyncClient() as h:
                r = await h.post(
                    srv.http + "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 2},
                    headers={"authorization": "Bearer k-a"},
                )
            await s.close()
            return refused, limited, r

        refused, limited, r = asyncio.run(main())
        assert refused is not None and refused.code == 1013 and "concurrent" in refused.reason
        assert isinstance(limited, Error) and limited.code == ErrorCode.RATE_LIMITED and limited.round == 0
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "concurrent" in r.json()["error"]["message"] or "tokens" in r.json()["error"]["message"]


def test_the_drain_refuses_the_waiters_at_once() -> None:
    """Requests waiting for a slot when the drain starts are refused then, not at their timeout
    (they held the drain up to --queue-wait)."""

    async def main() -> None:
        adm = Admission(capacity=1, max_waiting=4, wait_s=30)
        t = adm.try_acquire(ANY)
        waiters = [asyncio.create_task(adm.acquire(ANY)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert adm.waiting == 3
        start = asyncio.get_running_loop().time()
        adm.close()
        for w in waiters:
            with pytest.raises(AdmissionRefused, match="draining"):
                await w
        assert asyncio.get_running_loop().time() - start < 1
        assert adm.waiting == 0 and adm.in_use == 1  # the running one keeps its slot
        with pytest.raises(AdmissionRefused, match="draining"):
            await adm.acquire(ANY)
        adm.release(t)
        assert adm.in_use == 0

    asyncio.run(main())


def test_a_reloaded_key_file_changes_a_keys_rate() -> None:
    """A key whose tokens_per_min changes on reload keeps its bucket's level at the new limit (the
    bucket was made once per key and kept the old rate)."""
    adm = Admission(capacity=10, max_waiting=0, wait_s=0)
    adm.spend(Principal("k", False, None, 6000), 5900)  # 100 left of 6000
    adm.check_tokens(Principal("k", False, None, 6000), 90)
    slower = Principal("k", False, None, 60)  # reloaded: 60 a minute
    adm.check_tokens(slower, 60)  # the level is capped at the new minute's worth
    with pytest.raises(AdmissionRefused, match="60 tokens per minute"):
        adm.check_tokens(slower, 61)
    adm.spend(slower, 60)
    with pytest.raises(AdmissionRefused) as exc:
        adm.check_tokens(slower, 30)
    assert 29 <= exc.value.retry_after_s <= 31  # refilled at 1 token a second, not 100


def test_a_websocket_generation_reserves_its_whole_cost(tmp_path: Path) -> None:
    """A session's generation holds prompt + max_new_tokens against its key while it runs, as an
    HTTP request does (a new one was refused only once the bucket was empty, so two sessions could
    overdraw it), gets back what it did not generate, and one that can never fit is refused naming
    max_new_tokens."""
    keys = tmp_path / "keys"
    keys.write_text("k-100 tokens_per_min=100\n")
    with LiveServer(api_key_file=str(keys)) as srv:

        def ask(s: AsyncSession, seed: int, mode: Mode, new: int) -> bytes:
            return s.proto.prompt(Prompt(np.array(prompt_tokens(seed, 10)), mode, max_new_tokens=new))

        async def main() -> list[Message]:
            a = await AsyncSession.open(srv.ws, api_key="k-100")
            b = await AsyncSession.open(srv.ws, api_key="k-100")
            assert isinstance(await a.recv(), Welcome) and isinstance(await b.recv(), Welcome)
            out: list[Message] = []
            # a: 10 + 60 reserved; greedy with no tree, so it waits for a tree after round 0
            await a.ws.send(
                a.proto.prompt(Prompt(np.array(prompt_tokens(1, 10)), Mode.GREEDY, max_new_tokens=60))
            )
            out.append(await a.recv())
            # b: 10 + 30 does not fit in what is left
            await b.ws.send(
                b.proto.prompt(Prompt(np.array(prompt_tokens(2, 10)), Mode.AR, max_new_tokens=30))
            )
            out.append(await b.recv())
            # a cancels: the 59 tokens it did not generate come back, and b fits
            await a.ws.send(a.proto.cancel())
            out.append(await a.recv())
            await b.ws.send(
                b.proto.prompt(Prompt(np.array(prompt_tokens(2, 10)), Mode.AR, max_new_tokens=30))
            )
            out.append(await b.recv())
            # never fits: 10 + 95 > 100 a minute
            await a.ws.send(
                a.proto.prompt(Prompt(np.array(prompt_tokens(3, 10)), Mode.AR, max_new_tokens=95))
            )
            out.append(await a.recv())
            await a.close()
            await b.close()
            return out

        first, limited, cancelled, admitted, too_big = asyncio.run(main())
        assert isinstance(first, Verdict) and not first.done
        assert isinstance(limited, Error) and limited.code == ErrorCode.RATE_LIMITED, limited
        assert isinstance(cancelled, Verdict) and cancelled.done, cancelled
        assert isinstance(admitted, Verdict), admitted
        assert isinstance(too_big, Error) and too_big.code == ErrorCode.LIMIT_EXCEEDED, too_big
        assert too_big.field == "max_new_tokens" and "100 tokens per minute" in too_big.message
