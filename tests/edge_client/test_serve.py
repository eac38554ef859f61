"""`edge-client serve`: the local OpenAI-compatible endpoint, driven by the official `openai` client,
drafting with the tiny torch drafter and verifying on a live verifier: greedy output equals the
verifier's own target-only decoding; a seeded sampled request equals seeded `ar`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from edge_client.client import EdgeClient
from edge_client.drafters.registry import create_drafter
from edge_client.serve import create_app
from shared.messages import Mode, Prompt, Verdict, Welcome
from tests.cloud_verifier.service import AsyncSession, LiveServer, reference
from tests.edge_client.local_server import served

openai = pytest.importorskip("openai")


@contextmanager
def edge_api(verifier_url: str) -> Iterator[str]:
    drafter = create_drafter("torch", "tiny")
    app = create_app(lambda: EdgeClient(verifier_url, drafter, prespec=True))
    try:
        with served(app) as port:
            yield f"http://127.0.0.1:{port}/v1"
    finally:
        drafter.close()


def _ar(url: str, ids: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    async def run() -> list[int]:
        s = await AsyncSession.open(url)
        assert isinstance(await s.recv(), Welcome)
        await s.ws.send(s.proto.prompt(Prompt(np.array(ids), Mode.AR, temperature, 0, 1.0, seed, n)))
        out: list[int] = []
        while True:
            v = await s.recv()
            assert isinstance(v, Verdict)
            out += v.tokens.tolist()
            if v.done:
                await s.close()
                return out

    return asyncio.run(run())


def test_local_api_greedy_and_seeded_match_equal_the_verifiers_ar() -> None:
    with LiveServer() as srv, edge_api(srv.ws) as base:
        client: Any = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["tiny"]
        prompt = [5, 6, 7, 8, 5, 6, 7]
        # mode auto (the default) may let the tiny target stream (its forward costs what a drafter
        # evaluation does); greedy always speculates
        r = client.completions.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=24, extra_body={"mode": "greedy"}
        )
        want = reference(tuple(prompt), 24)
        auto = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=24)
        from tests.cloud_verifier.service import tiny

        text = tiny().tokenizer.decode([t for t in want if t not in tiny().eos_ids], skip_special=True)
        assert r.choices[0].text == text == auto.choices[0].text
        assert r.usage.completion_tokens == len(want)
        st = r.model_extra["treespec"]
        assert st["rounds"] >= 1 and st["tau"] > 1  # the tiny self-draft: several tokens a round
        # streaming chat: the same tokens as the verifier's own ar on the same chat prompt
        msgs = [{"role": "user", "content": "Count to five."}]
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=msgs, temperature=0, max_tokens=20, stream=True
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ids = tiny().tokenizer.encode(tiny().tokenizer.apply_chat_template(msgs), add_special=False)
        ar = _ar(srv.ws, ids, 20)
        assert streamed == tiny().tokenizer.decode(
            [t for t in ar if t not in tiny().eos_ids], skip_special=True
        )
        # seeded sampling: match through the edge == ar with the same seed
        r2 = client.completions.create(model="tiny", prompt=prompt, temperature=0.8, seed=9, max_tokens=24)
        ar2 = _ar(srv.ws, prompt, 24, 0.8, 9)
        assert r2.choices[0].text == tiny().tokenizer.decode(
            [t for t in ar2 if t not in tiny().eos_ids], skip_special=True
        )
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=4, n=3)
