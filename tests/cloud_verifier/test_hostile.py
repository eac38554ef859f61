"""Hostile clients against a live verifier, one frame of bad input per class: each fails alone with
its code, field and close code, and a concurrent honest session's output stays exactly the
target's. The other hostile behaviours are test_hostile_sessions.py's and test_hostile_load.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import msgpack
import numpy as np

from shared.errors import ErrorCode
from shared.messages import Mode, Prompt, Tree, Verdict, Welcome, encode
from shared.tree import TokenTree
from tests.cloud_verifier.hostile_helpers import _wait_idle
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    prompt_tokens,
    reference,
    run_greedy_async,
)
from tests.cloud_verifier.test_server import _q_tree

# ---------------------------------------------------------------- one frame of bad input per class
# (name, needs_prompt: False / True / "pending" / None for a foreign vocabulary, frame builder,
#  code, field, close code)
HostileCase = tuple[
    str, bool | str | None, Callable[[int], bytes] | None, ErrorCode | None, str | None, int | None
]


BAD_CASES: list[HostileCase] = [
    # (name, needs_prompt, frame builder (committed length -> bytes), code, field, close code or None)
    ("bad msgpack", False, lambda L: b"\xc1\x00", ErrorCode.BAD_FRAME, "frame", 1007),
    (
        "wrong types",
        False,
        lambda L: msgpack.packb({"type": "prompt", "tokens": [1, 2], "mode": "greedy"}),
        ErrorCode.BAD_MESSAGE,
        "tokens",
        1007,
    ),
    (
        "unknown type",
        False,
        lambda L: msgpack.packb({"type": "launch"}),
        ErrorCode.UNKNOWN_TYPE,
        "type",
        1007,
    ),
    (
        "tree before prompt",
        False,
        lambda L: encode(Tree(1, TokenTree.chain([1], base=1))),
        ErrorCode.BAD_ORDER,
        "type",
        None,
    ),
    (
        "mode not allowed",
        False,
        lambda L: encode(Prompt(tokens=np.array([1, 2]), mode=Mode.RRS, temperature=1.0)),
        ErrorCode.MODE_NOT_ALLOWED,
        "mode",
        None,
    ),
    (
        "prompt over max context",
        False,
        lambda L: encode(Prompt(tokens=np.array([5] * 600))),
        ErrorCode.CONTEXT_FULL,
        "tokens",
        None,
    ),
    (
        "id out of range",
        True,
        lambda L: encode(Tree(1, TokenTree.chain([49152], base=L))),
        ErrorCode.OUT_OF_RANGE,
        "tree.tokens",
        None,
    ),
    (
        "parent not earlier",
        True,
        lambda L: encode(Tree(1, TokenTree.build([1, 2], [-1, 1], base=L))),
        ErrorCode.BAD_TREE,
        "tree.parents",
        None,
    ),
    (
        "too many nodes",
        True,
        lambda L: encode(Tree(1, TokenTree.build(list(range(65)), [-1] * 65, base=L))),
        ErrorCode.LIMIT_EXCEEDED,
        "tree.tokens",
        None,
    ),
    (
        "draws in a deterministic mode",
        True,
        lambda L: encode(Tree(1, _q_tree(L, [5], [65536]))),
        ErrorCode.BAD_TREE,
        "tree.draws",
        None,
    ),
    (
        "round out of order",
        "pending",
        lambda L: encode(Tree(3, TokenTree.chain([1], base=L, cond=[9]))),
        ErrorCode.BAD_ORDER,
        "round",
        None,
    ),
    (
        "message over the limit",
        False,
        lambda L: encode(Prompt(tokens=np.array([1] * 20000))),
        None,
        None,
        1009,
    ),
    ("text frame", False, None, ErrorCode.BAD_FRAME, "frame", 1007),
    ("vocabulary mismatch", None, None, ErrorCode.VOCAB_MISMATCH, "vocab_fingerprint", 1008),
]


def _prompt_frame(**over: Any) -> bytes:
    """A valid prompt frame with some fields replaced (None: removed)."""
    d = msgpack.unpackb(encode(Prompt(tokens=np.array([1, 2, 3]), max_new_tokens=50)))
    for k, v in over.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return bytes(msgpack.packb(d, use_bin_type=True))


def _tree_frame(L: int, **over: Any) -> bytes:
    d = msgpack.unpackb(encode(Tree(1, TokenTree.chain([1], base=L))))
    d.update(over)
    return bytes(msgpack.packb(d, use_bin_type=True))


def _i32(*xs: int) -> bytes:
    return np.asarray(xs, dtype="<i4").tobytes()


MORE_CASES: list[HostileCase] = [
    # frames that are not one well-formed msgpack map: fatal, close 1007
    ("trailing bytes", False, lambda L: msgpack.packb({"type": "cancel"}) + b"\x00", ErrorCode.BAD_FRAME, "frame", 1007),
    ("not a map", False, lambda L: msgpack.packb([1, 2]), ErrorCode.BAD_FRAME, "frame", 1007),
    ("deep nesting", False, lambda L: b"\x91" * 5000 + b"\xc0", ErrorCode.BAD_FRAME, "frame", 1007),
    ("huge declared string", False, lambda L: b"\x81\xa4type\xdb\xff\xff\xff\xffx", ErrorCode.BAD_FRAME, "frame", 1007),
    ("huge declared array", False, lambda L: b"\x81\xa4type\xdd\xff\xff\xff\xff", ErrorCode.BAD_FRAME, "frame", 1007),
    ("non-string key", False, lambda L: msgpack.packb({1: 2}), ErrorCode.BAD_FRAME, "frame", 1007),
    ("duplicate key", False, lambda L: b"\x82\xa4type\xa6cancel\xa4type\xa6cancel", ErrorCode.BAD_FRAME, "frame", 1007),
    ("extension type", False, lambda L: b"\x81\xa4type\xd4\x01\x00", ErrorCode.BAD_FRAME, "frame", 1007),
    # fields missing, unknown, of the wrong type or out of range: fatal, close 1007, the field named
    ("type not a string", False, lambda L: msgpack.packb({"type": 5}), ErrorCode.UNKNOWN_TYPE, "type", 1007),
    ("missing tokens", False, lambda L: _prompt_frame(tokens=None), ErrorCode.BAD_MESSAGE, "tokens", 1007),
    ("unknown field", False, lambda L: _prompt_frame(speed=1), ErrorCode.BAD_MESSAGE, "speed", 1007),
    ("unknown mode", False, lambda L: _prompt_frame(mode="turbo"), ErrorCode.BAD_MESSAGE, "mode", 1007),
    ("temperature too high", False, lambda L: _prompt_frame(temperature=1e5), ErrorCode.BAD_MESSAGE, "temperature", 1007),
    ("temperature NaN", False, lambda L: _prompt_frame(temperature=float("nan")), ErrorCode.BAD_MESSAGE, "temperature", 1007),
    ("top_p zero", False, lambda L: _prompt_frame(top_p=0.0), ErrorCode.BAD_MESSAGE, "top_p", 1007),
    ("top_k negative", False, lambda L: _prompt_frame(top_k=-1), ErrorCode.BAD_MESSAGE, "top_k", 1007),
    ("seed negative", False, lambda L: _prompt_frame(seed=-1), ErrorCode.BAD_MESSAGE, "seed", 1007),
    ("max_new_tokens zero", False, lambda L: _prompt_frame(max_new_tokens=0), ErrorCode.BAD_MESSAGE, "max_new_tokens", 1007),
    ("tokens not whole int32s", False, lambda L: _prompt_frame(tokens=b"\x01\x02\x03"), ErrorCode.BAD_MESSAGE, "tokens", 1007),
    ("too many stop ids", False, lambda L: _prompt_frame(stop_ids=_i32(*range(300))), ErrorCode.LIMIT_EXCEEDED, "stop_ids", 1007),
    ("round zero", True, lambda L: _tree_frame(L, round=0), ErrorCode.BAD_MESSAGE, "round", 1007),
    ("negative base", True, lambda L: _tree_frame(L, base=-1), ErrorCode.BAD_MESSAGE, "base", 1007),
    # content the protocol refuses: an error naming the field, the session goes on
    ("prompt id out of range", False, lambda L: encode(Prompt(tokens=np.array([49152]))), ErrorCode.OUT_OF_RANGE, "tokens", None),
    ("stop id out of range", False, lambda L: encode(Prompt(tokens=np.array([1]), stop_ids=(49152,))), ErrorCode.OUT_OF_RANGE, "stop_ids", None),
    ("empty prompt", False, lambda L: encode(Prompt(tokens=np.array([]))), ErrorCode.BAD_MESSAGE, "tokens", None),
    ("continue with no context", False, lambda L: encode(Prompt(tokens=np.array([1]), continue_=True)), ErrorCode.BAD_ORDER, "continue", None),
    ("prompt while generating", True, lambda L: encode(Prompt(tokens=np.array([1, 2]))), ErrorCode.BAD_ORDER, "type", None),
    ("depth over the limit", True, lambda L: encode(Tree(1, TokenTree.chain(list(range(1, 18)), base=L))), ErrorCode.LIMIT_EXCEEDED, "tree.parents", None),
    ("cond over the limit", True, lambda L: encode(Tree(1, TokenTree.chain([1], base=L - 1, cond=[7] * 69))), ErrorCode.LIMIT_EXCEEDED, "tree.cond", None),
    ("cond id out of range", True, lambda L: encode(Tree(1, TokenTree.chain([1], base=L - 1, cond=[49152]))), ErrorCode.OUT_OF_RANGE, "tree.cond", None),
    ("repeated siblings", True, lambda L: encode(Tree(1, TokenTree.build([5, 5], [-1, -1], base=L))), ErrorCode.BAD_TREE, "tree.tokens", None),
    ("parents shorter than tokens", True, lambda L: _tree_frame(L, tokens=_i32(1, 2), parents=_i32(-1)), ErrorCode.BAD_TREE, "tree.parents", None),
]  # fmt: skip


HOSTILE_CASES = BAD_CASES + MORE_CASES


def test_hostile_input_classes_hurt_nobody_else() -> None:
    """Each bad input gets the right error (naming the field); meanwhile /readyz stays 200 and a
    healthy session running concurrently on the same engine produces exactly the target's output."""
    healthy_prompt = prompt_tokens(77, 20)

    async def healthy(url: str) -> list[int]:
        s = await AsyncSession.open(url)
        assert isinstance(await s.recv(), Welcome)
        out = await run_greedy_async(s, healthy_prompt, 64, seed=5, nodes=4)
        await s.close()
        return out

    async def attack(url: str, http: str) -> list[str]:

        results = []
        for name, needs_prompt, frame, code, field, close in HOSTILE_CASES:
            if needs_prompt is None:  # hello with a foreign vocabulary
                s = await AsyncSession.open(url, fingerprint="0" * 64)
            else:
                s = await AsyncSession.open(url)
                assert isinstance(await s.recv(), Welcome)
            if needs_prompt:
                await s.ws.send(s.proto.prompt(Prompt(tokens=np.array([1, 2, 3]), max_new_tokens=50)))
                assert isinstance(await s.recv(), Verdict)
            if needs_prompt == "pending":  # round 7 waits as a conditional tree; round 3 comes after it
                await s.ws.send(
                    encode(Tree(7, TokenTree.chain([1], base=len(s.proto.committed), cond=[9, 9, 9])))
                )
            L = len(s.proto.committed)
            if frame is None and needs_prompt is False:
                await s.ws.send("not msgpack")  # a text frame
            elif frame is not None:
                await s.ws.send(frame(L))
            got: dict[str, Any] = {}
            if code is not None:
                err = msgpack.unpackb(await s.ws.recv())
                got = {k: err.get(k) for k in ("type", "code", "field", "fatal")}
                want = {"type": "error", "code": code.value, "field": field, "fatal": close is not None}
                if got != want:
                    wrong.append(f"{name}: {got} instead of {want}")
            if close is not None:
                try:
                    await asyncio.wait_for(s.ws.recv(), 5)
                    wrong.append(f"{name}: connection stayed open")
                except Exception as exc:  # ConnectionClosed
                    rcvd = getattr(exc, "rcvd", None)
                    if rcvd is None or rcvd.code != close:
                        wrong.append(f"{name}: closed with {rcvd} instead of {close}")
                    table.append((name, got.get("code"), got.get("field"), rcvd.code if rcvd else None))
            else:  # the session goes on: a valid round still works
                if needs_prompt:
                    await s.ws.send(encode(Tree(8, TokenTree.chain([1], base=len(s.proto.committed)))))
                    kinds = [msgpack.unpackb(await s.ws.recv())["type"]]
                    while kinds[-1] == "stale":
                        kinds.append(msgpack.unpackb(await s.ws.recv())["type"])
                    if kinds[-1] != "verdict":
                        wrong.append(f"{name}: the session did not go on ({kinds})")
                table.append((name, got.get("code"), got.get("field"), None))
            async with httpx.AsyncClient() as h:
                assert (await h.get(http + "/readyz")).status_code == 200, name
            await s.ws.close()
            results.append(name)
        return results

    with LiveServer(max_bytes=40_000, max_context=512) as srv:

        async def main() -> tuple[list[int], list[str]]:
            h = asyncio.create_task(healthy(srv.ws))
            names = await attack(srv.ws, srv.http)
            return await h, names

        wrong: list[str] = []
        table: list[tuple[str, Any, Any, Any]] = []
        out, names = asyncio.run(main())
        for row in table:  # the class -> reply table (pytest -s shows it)
            print(f"{row[0]:32s} {row[1] or '-':18s} {row[2] or '-':18s} {row[3] or 'session goes on'}")
        assert not wrong, "\n".join(wrong)
        assert out == reference(tuple(healthy_prompt), 64)
        assert len(names) == len(HOSTILE_CASES) >= 35
        _wait_idle(srv)
