"""The edge client's own limits against a lying verifier: a verdict that breaks the protocol is
refused before anything is emitted, and verdicts that never end stop at max_new_tokens."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import numpy as np
import pytest

from edge_client.client import (
    GenerationError,
    ProtocolViolation,
)
from shared.errors import ErrorCode
from shared.messages import (
    Prompt,
    Stale,
    Tree,
    Verdict,
    decode,
    encode,
)
from shared.protocol import ClientState
from tests.edge_client.fake_drafter import FakeDrafter
from tests.edge_client.hostile_verifier import (
    PROMPT,
    Honest,
    Script,
    V,
    _client,
    _honest_tokens,
    _recv_bytes,
    _run,
    _tokens,
    _welcome,
    liar,
)

Lie = Callable[[Honest], bytes]


def _after_one_honest_round(lie: Lie) -> Script:
    """Answer the prompt and the first tree honestly, then send `lie` for the second tree."""

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.next()
        await s.next()
        msg = decode(await _recv_bytes(s.ws))
        assert isinstance(msg, Tree)
        s.trees[msg.round] = msg
        s.srv.receive(encode(msg))
        await s.ws.send(lie(s))
        await asyncio.sleep(3600)

    return script


def _last_round(s: Honest) -> int:
    return max(s.trees)


def _path_lie(s: Honest, kind: str) -> bytes:
    """A verdict for the last tree whose accepted nodes or tokens are not the tree's."""
    r = _last_round(s)
    tree = s.trees[r].tree
    kids = [i for i in range(tree.num_nodes) if tree.parents[i] == -1]
    deep = [i for i in range(tree.num_nodes) if tree.parents[i] != -1]
    if kind == "node outside the tree":
        return s.verdict_frame(r, [1, 2], [tree.num_nodes])
    if kind == "negative node":
        return s.verdict_frame(r, [1, 2], [-1])
    if kind == "not a path":
        return s.verdict_frame(r, [int(tree.tokens[deep[0]]), 2], [deep[0]])
    if kind == "tokens not the nodes'":
        t = int(tree.tokens[kids[0]])
        return s.verdict_frame(r, [(t + 1) % V or 1, 2], [kids[0]])
    if kind == "two bonus tokens":
        return s.verdict_frame(r, [3, 4], [], has_bonus=True)
    if kind == "has_bonus wrong":
        return s.verdict_frame(r, [3], [], has_bonus=False)
    raise AssertionError(kind)


LIES: dict[str, tuple[Lie, type[GenerationError], ErrorCode, str]] = {
    "4000 tokens for max_new_tokens 8": (
        lambda s: s.verdict_frame(_last_round(s), [3] * 4000, []),
        ProtocolViolation,
        ErrorCode.LIMIT_EXCEEDED,
        "tokens",
    ),
    "a token >= vocab_size": (
        lambda s: s.verdict_frame(_last_round(s), [V + 5], []),
        ProtocolViolation,
        ErrorCode.OUT_OF_RANGE,
        "tokens",
    ),
    "a negative token": (
        lambda s: s.verdict_frame(_last_round(s), [-3], []),
        ProtocolViolation,
        ErrorCode.OUT_OF_RANGE,
        "tokens",
    ),
    **{
        kind: (
            functools.partial(_path_lie, kind=kind),
            ProtocolViolation,
            ErrorCode.BAD_MESSAGE,
            fld,
        )
        for kind, fld in [
            ("node outside the tree", "accepted_nodes"),
            ("negative node", "accepted_nodes"),
            ("not a path", "accepted_nodes"),
            ("tokens not the nodes'", "tokens"),
            ("two bonus tokens", "tokens"),
            ("has_bonus wrong", "has_bonus"),
        ]
    },
    "a verdict for a round never sent": (
        lambda s: s.verdict_frame(_last_round(s) + 7, [3], []),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "round",
    ),
    "a duplicate verdict": (
        lambda s: s.verdict_frame(_last_round(s) - 1, [3], []),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "round",
    ),
    "committed_len going backwards": (
        lambda s: s.verdict_frame(_last_round(s), [3], [], committed_len=2),
        ProtocolViolation,
        ErrorCode.BAD_MESSAGE,
        "committed_len",
    ),
    "a next_round never sent": (
        lambda s: s.verdict_frame(_last_round(s), [3], [], next_round=99),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "next_round",
    ),
    "an empty verdict that is not done": (
        lambda s: s.verdict_frame(_last_round(s), [], [], has_bonus=False),
        ProtocolViolation,
        ErrorCode.BAD_MESSAGE,
        "done",
    ),
    "a stale for a round never sent": (
        lambda s: encode(Stale(_last_round(s) + 3, "x")),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "round",
    ),
    "garbage": (lambda s: b"\x93\x01\x02", ProtocolViolation, ErrorCode.BAD_FRAME, "frame"),
    "a second welcome": (
        lambda s: encode(_welcome(s.fingerprint)),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "state",
    ),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_verdict_is_refused_before_anything_is_emitted(lie: str) -> None:
    d = FakeDrafter(V)
    make, exc_type, code, fld = LIES[lie]
    chunks: list[str] = []

    async def main() -> tuple[list[int], ClientState]:
        async with liar(_after_one_honest_round(make), d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            with pytest.raises(exc_type) as info:
                async for chunk in c.generate(PROMPT, max_new_tokens=8):
                    chunks.append(chunk)
            assert info.value.code is code and info.value.field == fld, info.value
            assert c.last is not None
            tokens = list(c.last.tokens)
            state = c.proto.state
            await c.close()
            return tokens, state

    tokens, state = _run(main())
    assert tokens == _honest_tokens(2)  # the two honest rounds, nothing of the lie
    assert "".join(chunks) == "".join(f"<{t}>" for t in tokens)
    assert state is ClientState.START  # the lying connection was dropped


def test_verdicts_that_never_end_stop_at_max_new_tokens() -> None:
    """A verifier that keeps the generation going past max_new_tokens (done never set)."""
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        while True:
            msg = decode(await _recv_bytes(s.ws))
            n = s.prompt_len
            if isinstance(msg, Prompt):
                s.prompt_len = n = len(msg.tokens)
                rnd = 0
            else:
                assert isinstance(msg, Tree)
                rnd = msg.round
            s.prompt_len = n + 1
            await s.ws.send(
                encode(Verdict(rnd, np.asarray([3], np.int32), np.zeros(0, np.int32), True, n + 1))
            )

    async def main() -> list[int]:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            with pytest.raises(ProtocolViolation) as info:
                await _tokens(c, 8)
            assert info.value.field == "done"
            assert c.last is not None
            return list(c.last.tokens)

    assert _run(main()) == [3] * 7
