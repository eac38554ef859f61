"""What the verifier's hostile tests share: an honest session generating beside the hostile one and
checked against the target, a session's close code and reason, and waiting for the verifier to
fall idle."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np

from shared.messages import Error, Mode, Prompt, Tree, Verdict, Welcome
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    reference,
    run_greedy_async,
    scripted_tree,
)


async def _generate(
    url: str,
    prompt: list[int],
    n: int,
    mode: Mode,
    temperature: float,
    top_p: float,
    seed: int,
    guess: list[int] | None = None,
) -> tuple[list[int], Error | None]:
    """One generation driven to its end (ar: token by token; match: trees scripted from `guess`,
    by default the target's greedy continuation)."""
    s = await AsyncSession.open(url)
    assert isinstance(await s.recv(), Welcome)
    rng = random.Random(seed)
    ref = prompt + (guess if guess is not None else reference(tuple(prompt), n))
    first = scripted_tree(rng, prompt, ref, 6) if mode is not Mode.AR else None
    p = Prompt(np.array(prompt), mode, temperature, 0, top_p, seed, n, tree=first)
    await s.ws.send(s.proto.prompt(p))
    out: list[int] = []
    try:
        while True:
            msg = await s.recv()
            if isinstance(msg, Error):
                return out, msg
            if not isinstance(msg, Verdict):
                continue
            out.extend(msg.tokens.tolist())
            if msg.done:
                return out, None
            if mode is not Mode.AR:
                s.round += 1
                tree = scripted_tree(rng, list(s.proto.committed), ref, 6)
                await s.ws.send(s.proto.tree(Tree(s.round, tree)))
    finally:
        await s.close()


async def _honest(url: str, prompt: list[int], n: int, seed: int) -> list[int]:
    """An honest greedy session beside the attacks (scripted trees); its tokens."""
    s = await AsyncSession.open(url)
    assert isinstance(await s.recv(), Welcome)
    out = await run_greedy_async(s, prompt, n, seed=seed, nodes=4)
    await s.close()
    return out


def _closed_with(sess: AsyncSession) -> Any:
    """Wait for the server to close the connection; returns its close frame (code, reason)."""

    async def wait() -> Any:
        try:
            while True:
                await asyncio.wait_for(sess.ws.recv(), 10)
        except Exception as exc:  # ConnectionClosed
            return getattr(exc, "rcvd", None)

    return wait()


def _wait_idle(srv: LiveServer) -> None:
    import time

    deadline = time.monotonic() + 5
    while srv.engine.seqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not srv.engine.seqs and srv.engine.kv.blocks_in_use == 0
