"""Admission control and per-key limits: slots, the bounded queue, tokens per minute (no model),
then the same limits through a live verifier (WebSocket 1013 / RATE_LIMITED, HTTP 429 + Retry-After)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
from websockets.frames import Close

from cloud_verifier.admission import Admission, Refused
from cloud_verifier.auth import KeyStore, Principal
from shared.errors import ErrorCode
from shared.messages import Error, Message, Mode, Prompt, Verdict, Welcome
from tests.cloud_verifier.service import AsyncSession, LiveServer, prompt_tokens

ANY = Principal("anonymous", False)


def test_slots_and_the_bounded_queue() -> None:
    async def main() -> None:
        adm = Admission(capacity=2, max_waiting=1, wait_s=0.3)
        a, b = adm.try_acquire(ANY), await adm.acquire(ANY)
        with pytest.raises(Refused):
            adm.try_acquire(ANY)  # full, and a WebSocket does not wait
        waiter = asyncio.create_task(adm.acquire(ANY))
        await asyncio.sleep(0.01)
        assert adm.waiting == 1
        with pytest.raises(Refused, match="already wait"):
            await adm.acquire(ANY)  # the queue is full: refused at once
        adm.release(a)  # the slot passes to the waiter
        c = await waiter
        assert adm.in_use == 2 and adm.waiting == 0
        with pytest.raises(Refused, match="within") as exc:
            await adm.acquire(ANY)  # waits 0.3 s, no slot frees
        assert exc.value.retry_after_s >= 1
        adm.release(b)
        adm.release(c)
        assert adm.in_use == 0
        adm.closed = True
        with pytest.raises(Refused, match="draining"):
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
    with pytest.raises(Refused, match="1 concurrent"):
        adm.try_acquire(a)
    adm.try_acquire(b)  # another key is not limited by it
    adm.release(t)
    adm.spend(a, 150)  # 30 over the bucket: two tokens a second refill it
    with pytest.raises(Refused, match="tokens per minute") as exc:
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
            # spend the key's 20 tokens a minute, then ask again
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(1)), Mode.AR, max_new_tokens=25)))
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
