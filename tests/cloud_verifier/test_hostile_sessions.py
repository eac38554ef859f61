"""Hostile sessions against a live verifier: temperatures that overflow, a round that fails, silence
mid-generation, connections that never send, a prompt that fills the KV pool. Each fails alone and
a concurrent honest session's output stays exactly the target's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from cloud_verifier import step as step_module
from cloud_verifier import verify as verify_module
from cloud_verifier.verify import Algorithm
from shared.errors import ErrorCode
from shared.messages import Error, Mode, Prompt, Verdict, Welcome
from tests.cloud_verifier.hostile_helpers import _closed_with, _generate, _honest, _wait_idle
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    prompt_tokens,
    reference,
    run_greedy_async,
    tiny,
)

# temperatures inside the protocol's range at which logits / T overflows (float32, and float64 too)
TINY_TEMPERATURES = (1e-300, 1e-45, 1e-38, 5e-324)


def test_tiny_temperatures_sample_the_argmax_and_hurt_nobody() -> None:
    """The probe's attack: prompts at temperatures whose logits / T overflow (with and without top-p,
    in ar and match) used to turn the logits into NaN, fail the engine step and end every concurrent
    session with INTERNAL. Now each such generation is the greedy one (the T -> 0 limit) and the
    honest sessions sharing its steps are exactly the target's."""
    honest_prompts = [prompt_tokens(100 + i, 16) for i in range(3)]
    attacks = [
        (Mode.AR, 1e-300, 0.5),
        (Mode.MATCH, 1e-45, 0.9),
        (Mode.AR, 1e-38, 1.0),
        (Mode.MATCH, 5e-324, 1.0),
    ]
    with LiveServer() as srv:

        async def main() -> tuple[list[list[int]], list[tuple[list[int], Error | None]]]:
            good = [asyncio.create_task(_honest(srv.ws, p, 40, i)) for i, p in enumerate(honest_prompts)]
            bad = [
                asyncio.create_task(_generate(srv.ws, prompt_tokens(200 + i), 24, m, t, tp, seed=i))
                for i, (m, t, tp) in enumerate(attacks)
            ]
            return [await g for g in good], [await b for b in bad]

        good, bad = asyncio.run(main())
        for p, out in zip(honest_prompts, good, strict=True):
            assert out == reference(tuple(p), 40)
        for i, (out, err) in enumerate(bad):
            assert err is None, (attacks[i], err)
            assert out == reference(tuple(prompt_tokens(200 + i)), 24), attacks[i]
        assert httpx.get(srv.http + "/readyz").status_code == 200


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """A verifier bug that only one session's input triggers: verification raises for sessions
    seeded POISON, and the packed forward raises whenever a session feeds the token POISON."""
    poison = {"seed": 666, "token": 4242, "forward_failures": 0}
    real_verify = verify_module.verify_tree

    def verify_tree(algorithm: Algorithm, tree: Any, logits: Any, params: Any, **kw: Any) -> Any:
        if kw.get("seed") == poison["seed"]:
            raise RuntimeError("injected verification failure")
        return real_verify(algorithm, tree, logits, params, **kw)

    model = tiny().model
    real_forward = model.forward_packed

    def forward_packed(inputs: Any, kv: Any) -> Any:
        if any(int(poison["token"]) in inp.tokens.tolist() for inp in inputs):
            poison["forward_failures"] += 1
            raise RuntimeError("injected forward failure")
        return real_forward(inputs, kv)

    monkeypatch.setattr(step_module, "verify_tree", verify_tree)
    monkeypatch.setattr(model, "forward_packed", forward_packed)
    yield poison


def test_a_failing_round_fails_alone(poisoned: dict[str, int]) -> None:
    """A round whose verification or forward raises ends only its own session (INTERNAL, with the
    round); the honest sessions packed into the same steps finish with the target's exact tokens,
    and the engine stays ready."""
    honest_prompts = [prompt_tokens(300 + i, 16) for i in range(3)]
    with LiveServer() as srv:

        async def attacker(prompt: list[int], seed: int) -> tuple[list[int], Error | None]:
            await asyncio.sleep(0.05)  # join while the honest sessions are mid-generation
            return await _generate(srv.ws, prompt, 24, Mode.MATCH, 0.8, 1.0, seed, guess=[5] * 24)

        async def main() -> tuple[list[list[int]], list[tuple[list[int], Error | None]]]:
            good = [asyncio.create_task(_honest(srv.ws, p, 40, i)) for i, p in enumerate(honest_prompts)]
            bad = [
                asyncio.create_task(attacker(prompt_tokens(400), poisoned["seed"])),
                asyncio.create_task(attacker([*prompt_tokens(401, 8), poisoned["token"]], 7)),
            ]
            return [await g for g in good], [await b for b in bad]

        good, bad = asyncio.run(main())
        for p, out in zip(honest_prompts, good, strict=True):
            assert out == reference(tuple(p), 40)
        for out, err in bad:
            assert out == [] and err is not None
            assert err.code == ErrorCode.INTERNAL and err.round == 0, err
        assert poisoned["forward_failures"] >= 1
        assert httpx.get(srv.http + "/readyz").status_code == 200


def test_idle_timeout_closes_a_session_that_went_silent_mid_generation() -> None:
    """hello + a greedy prompt, then silence: the verdict goes out, no tree comes back, and the
    session is closed (1001) after the idle timeout instead of holding its slot and KV forever."""
    with LiveServer(idle_timeout_s=0.5) as srv:

        async def main() -> Any:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(
                s.proto.prompt(Prompt(np.array(prompt_tokens(1)), Mode.GREEDY, max_new_tokens=100))
            )
            assert isinstance(await s.recv(), Verdict)
            return await _closed_with(s)

        rcvd = asyncio.run(main())
        assert rcvd is not None and rcvd.code == 1001 and "idle" in rcvd.reason
        _wait_idle(srv)


def test_an_ar_stream_is_not_idle() -> None:
    """A client that only reads (mode ar sends nothing after the prompt) is never idle while the
    engine works for it."""
    with LiveServer(idle_timeout_s=0.2) as srv:

        async def main() -> list[int]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(2)), Mode.AR, max_new_tokens=60)))
            out: list[int] = []
            while True:
                v = await s.recv()
                assert isinstance(v, Verdict)
                out.extend(v.tokens.tolist())
                await asyncio.sleep(0.01)  # a slow reader: the stream outlasts the idle timeout
                if v.done:
                    await s.close()
                    return out

        assert asyncio.run(main()) == reference(tuple(prompt_tokens(2)), 60)


def test_silent_connections_take_no_session_slot() -> None:
    """64 WebSockets that never say hello: an honest client still gets a session, and the silent
    ones are closed (1008) at the hello deadline."""
    with LiveServer(max_sessions=2, max_handshakes=80, hello_timeout_s=1.0) as srv:

        async def main() -> tuple[list[int], list[Any]]:
            from websockets.asyncio.client import connect

            silent = [await connect(srv.ws) for _ in range(64)]
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            out = await run_greedy_async(s, prompt_tokens(3), 20, seed=1, nodes=4)
            await s.close()
            closes = []
            for ws in silent:
                try:
                    await asyncio.wait_for(ws.recv(), 10)
                except Exception as exc:
                    closes.append(getattr(exc, "rcvd", None))
            return out, closes

        out, closes = asyncio.run(main())
        assert out == reference(tuple(prompt_tokens(3)), 20)
        assert all(c is not None and c.code == 1008 and "hello" in c.reason for c in closes), closes[:3]


def test_kv_full_answers_a_prompt_once() -> None:
    """A prompt that does not fit the KV pool gets one BUSY error (round 0) and no verdict after
    it; the session stays usable for a prompt that fits."""
    with LiveServer(kv_blocks=8, block_size=16) as srv:

        async def main() -> tuple[Any, list[int]]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(
                s.proto.prompt(Prompt(np.array(prompt_tokens(4, 200)), Mode.GREEDY, max_new_tokens=8))
            )
            err = await s.recv()
            out = await run_greedy_async(s, prompt_tokens(5, 10), 20, seed=2, nodes=4)
            await s.close()
            return err, out

        err, out = asyncio.run(main())
        assert isinstance(err, Error) and err.code == ErrorCode.BUSY and err.round == 0 and not err.fatal
        assert out == reference(tuple(prompt_tokens(5, 10)), 20)
