"""The OpenAI-compatible API, driven by the official `openai` client against a live verifier:
greedy output equals target-only decoding token for token, streaming or not; a seeded sampled
request equals a seeded `ar` session; refused parameters name themselves."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np
import pytest

from cloud_verifier.openai_api import TextStream
from shared.messages import Mode, Prompt, Verdict, Welcome
from shared.model import greedy_generate
from tests.cloud_verifier.service import AsyncSession, LiveServer, prompt_tokens, reference, tiny

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Write a haiku about rain."}]


def _client(srv: LiveServer, key: str = "none") -> Any:
    return openai.OpenAI(base_url=srv.http + "/v1", api_key=key, max_retries=0, timeout=60)


def _chat_ids() -> list[int]:
    t = tiny()
    return t.tokenizer.encode(t.tokenizer.apply_chat_template(MESSAGES), add_special=False)


def _text(ids: list[int]) -> str:
    t = tiny()
    return t.tokenizer.decode([i for i in ids if i not in t.eos_ids], skip_special=True)


def test_models_and_greedy_chat_equal_target_only_decoding() -> None:
    want = reference(tuple(_chat_ids()), 24)
    with LiveServer() as srv:
        client = _client(srv)
        (model,) = [m.id for m in client.models.list()]
        assert model == "tiny"
        r = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=24,
            extra_body={"return_token_ids": True},
        )
        choice = r.choices[0]
        assert choice.token_ids == want
        assert choice.message.content == _text(want)
        assert choice.finish_reason == ("length" if len(want) == 24 else "stop")
        assert r.usage is not None and r.usage.prompt_tokens == len(_chat_ids())
        assert r.usage.completion_tokens == len(want)
        # streaming: the same text, in pieces, ending with a finish reason
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=MESSAGES,
                temperature=0,
                max_tokens=24,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == _text(want)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [choice.finish_reason]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want)


def test_completions_greedy_streaming_and_not() -> None:
    prompt = "def fibonacci(n):"
    ids = tiny().tokenizer.encode(prompt)
    want = reference(tuple(ids), 20)
    with LiveServer() as srv:
        client = _client(srv)
        r = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=20)
        assert r.choices[0].text == _text(want)
        streamed = client.completions.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=20, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == _text(want)
        # token ids as the prompt
        r2 = client.completions.create(
            model="tiny", prompt=ids, temperature=0, max_tokens=20, extra_body={"return_token_ids": True}
        )
        assert r2.choices[0].token_ids == want


def test_seeded_sampling_equals_a_seeded_ar_session() -> None:
    """The keyed sampler depends only on (seed, position): the HTTP request and a WebSocket `ar`
    session with the same seed, temperature and top-p emit the same tokens."""
    ids = prompt_tokens(21, 10)
    with LiveServer() as srv:

        async def ar_session() -> list[int]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(np.array(ids), Mode.AR, 0.8, 0, 0.95, 1234, 30)))
            out: list[int] = []
            while True:
                v = await s.recv()
                assert isinstance(v, Verdict)
                out.extend(v.tokens.tolist())
                if v.done:
                    await s.close()
                    return out

        want = asyncio.run(ar_session())
        r = _client(srv).completions.create(
            model="tiny",
            prompt=ids,
            temperature=0.8,
            top_p=0.95,
            seed=1234,
            max_tokens=30,
            extra_body={"return_token_ids": True},
        )
        assert r.choices[0].token_ids == want
        assert want != reference(tuple(ids), 30)  # it did sample


def test_refused_parameters_and_auth(tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k-1\n")
    with LiveServer(api_key_file=str(keys), max_context=512) as srv:
        with pytest.raises(openai.AuthenticationError):
            _client(srv, "wrong").models.list()
        client = _client(srv, "k-1")
        for kw, param in (
            ({"n": 2}, "n"),
            ({"logprobs": True}, "logprobs"),
            ({"temperature": -1}, "temperature"),
            ({"max_tokens": 10_000}, "max_tokens"),
            ({"stop": ["a"] * 5}, "stop"),
            ({"model": "gpt-4"}, "model"),
        ):
            args: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kw}
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(**args)
            assert err.value.status_code in (400, 404), kw
            assert err.value.body["param"] == param, (kw, err.value.body)
        r = httpx.post(
            srv.http + "/v1/chat/completions", content=b"{not json", headers={"authorization": "Bearer k-1"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# a prompt whose greedy continuation is end-of-text at once (tiny's eos id 0 repeats itself)
EOS_PROMPT = [36213, 31264, 29015, 34170, 17074, 4084, 0]


def test_ignore_eos_generates_exactly_max_tokens() -> None:
    """vLLM's ignore_eos: an end-of-text token does not end the generation, so a request gets
    max_tokens tokens, streamed or not: the target's greedy continuation with no stop ids."""
    t = tiny()
    want = greedy_generate(t.model, t.new_kv_cache(256, 16), EOS_PROMPT, 12, eos_ids=())
    assert want[0] in t.eos_ids  # without ignore_eos it ends at once
    with LiveServer() as srv:
        body: dict[str, Any] = {
            "prompt": EOS_PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "return_token_ids": True,
        }
        plain = httpx.post(srv.http + "/v1/completions", json=body, timeout=60).json()
        assert plain["usage"]["completion_tokens"] == 1 and plain["choices"][0]["finish_reason"] == "stop"
        r = httpx.post(srv.http + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60).json()
        assert r["choices"][0]["token_ids"] == want and r["usage"]["completion_tokens"] == 12
        assert r["choices"][0]["finish_reason"] == "length"
        stream = {**body, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream(
            "POST",
            srv.http + "/v1/chat/completions",
            json={
                **{k: v for k, v in stream.items() if k != "prompt"},
                "messages": MESSAGES,
            },
            timeout=60,
        ) as resp:
            lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
        usage = json.loads(lines[-1][6:])["usage"]
        assert usage["completion_tokens"] == 12
        bad = httpx.post(srv.http + "/v1/completions", json={**body, "ignore_eos": "yes"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ignore_eos"


def test_text_stream_cuts_at_stop_strings_across_tokens() -> None:
    t = tiny()
    text = "Hello world. The end is near."
    ids = t.tokenizer.encode(text, add_special=False)
    s = TextStream(t, ["end is"])
    out = "".join(s.add([i]) for i in ids) + s.finish()
    assert out == "Hello world. The " and s.stopped
    s = TextStream(t, ["zzz"])
    assert "".join(s.add([i]) for i in ids) + s.finish() == text and not s.stopped
