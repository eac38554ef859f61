"""Pieces of the service tests: a tiny target loaded once, a blocking protocol client over
Starlette's TestClient, a scripted tree proposer and the target-only reference."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
from fastapi.testclient import TestClient

from cloud_verifier.server import ThreadedServer, create_app
from cloud_verifier.server_config import ServerConfig
from shared.messages import Error, Hello, Message, Mode, Prompt, Stale, Tree, Verdict, Welcome
from shared.model import Target, greedy_generate, load_target
from shared.protocol import ClientProtocol
from shared.tree import TokenTree

BASE = ServerConfig(model="tiny", measure_cost=False, max_sessions=8, max_context=512, kv_blocks=2048)


@functools.cache
def tiny() -> Target:
    return load_target("tiny", progress=False)


def slow_forwards(monkeypatch: Any, seconds: float) -> None:
    """Make `tiny`'s every forward take `seconds` more (a sleep, no CPU): a verifier as slow as the
    real pair's on a CPU, so an edge's work during a verification has time, whatever the load."""
    model = tiny().model
    real = model.forward_packed

    def slow(inputs: Any, kv: Any) -> Any:
        time.sleep(seconds)
        return real(inputs, kv)

    monkeypatch.setattr(model, "forward_packed", slow)


@functools.cache
def reference(prompt: tuple[int, ...], n: int) -> list[int]:
    """Target-only greedy continuation (the oracle every greedy session must reproduce)."""
    t = tiny()
    kv = t.new_kv_cache(256, 16)
    return greedy_generate(t.model, kv, list(prompt), n, eos_ids=t.eos_ids)


def prompt_tokens(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def scripted_tree(
    rng: random.Random, committed: list[int], ref_full: list[int], nodes: int = 8, base: int | None = None
) -> TokenTree:
    """A tree whose first branch follows the reference for a random number of tokens and then
    errs, with wrong siblings: every verification path (accept, reject, bonus) gets exercised."""
    L = len(committed)
    ahead = ref_full[L : L + nodes]
    good = rng.randint(0, len(ahead))
    chain = ahead[:good]
    seqs = [[*chain, rng.randrange(3, 49152)]]
    for _ in range(2):
        seqs.append([rng.randrange(3, 49152) for _ in range(rng.randint(1, 3))])
    tree = TokenTree.from_sequences(
        seqs, base=L if base is None else base, cond=committed[base:] if base else ()
    )
    keep = np.arange(min(tree.num_nodes, nodes))
    return TokenTree.build(tree.tokens[keep], tree.parents[keep], tree.base, tree.cond)


@contextmanager
def service(config: ServerConfig = BASE, **overrides: Any) -> Iterator[TestClient]:
    app = create_app(replace(config, **overrides), target=tiny())
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.02)
        yield client


class WsSession:
    """A blocking protocol client on a TestClient websocket."""

    def __init__(
        self, client: TestClient, api_key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        self._cm = client.websocket_connect("/v1/session", headers=headers or {})
        self.ws = self._cm.__enter__()
        self.proto = ClientProtocol()
        self.welcome: Welcome | None = None
        self.api_key = api_key
        self.round = 0

    def hello(self, fingerprint: str | None = None) -> Message:
        fp = fingerprint or tiny().vocab_fingerprint
        self.ws.send_bytes(self.proto.hello(Hello(vocab_fingerprint=fp, api_key=self.api_key)))
        msg = self.recv()
        if isinstance(msg, Welcome):
            self.welcome = msg
        return msg

    def recv(self) -> Message:
        return self.proto.receive(self.ws.receive_bytes())

    def send_raw(self, data: bytes) -> None:
        self.ws.send_bytes(data)

    def recv_raw(self) -> MutableMapping[str, Any]:
        return self.ws.receive()

    def prompt(self, p: Prompt) -> None:
        self.ws.send_bytes(self.proto.prompt(p))

    def tree(self, tree: TokenTree, round_id: int | None = None) -> int:
        self.round = round_id if round_id is not None else max(self.round, self.proto.last_round) + 1
        self.ws.send_bytes(self.proto.tree(Tree(self.round, tree)))
        return self.round

    def close(self) -> None:
        self._cm.__exit__(None, None, None)

    def __enter__(self) -> WsSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_greedy(
    sess: WsSession, prompt: list[int], n: int, seed: int, nodes: int = 8, mode: Mode = Mode.GREEDY
) -> tuple[list[int], list[Verdict]]:
    """Drive one greedy generation with the scripted proposer; returns (new tokens, verdicts)."""
    rng = random.Random(seed)
    ref = prompt + reference(tuple(prompt), n)
    sess.prompt(
        Prompt(
            tokens=np.array(prompt), mode=mode, max_new_tokens=n, tree=scripted_tree(rng, prompt, ref, nodes)
        )
    )
    out: list[int] = []
    verdicts: list[Verdict] = []
    while True:
        msg = sess.recv()
        if isinstance(msg, (Stale,)):
            continue
        if isinstance(msg, Error):
            raise AssertionError(f"unexpected error {msg}")
        assert isinstance(msg, Verdict), msg
        verdicts.append(msg)
        out.extend(msg.tokens.tolist())
        if msg.done:
            return out, verdicts
        sess.tree(scripted_tree(rng, list(sess.proto.committed), ref, nodes))


class LiveServer(ThreadedServer):
    """The real service on uvicorn (loopback, free port) serving `tiny` unless told otherwise."""

    def __init__(self, config: ServerConfig = BASE, target: Target | None = None, **overrides: Any) -> None:
        super().__init__(replace(config, **overrides), target=target or tiny())

    def __enter__(self) -> LiveServer:
        self.start()
        self.ws = self.url
        return self

    @property
    def engine(self) -> Any:
        return self.state.engine


class AsyncSession:
    """An asyncio protocol client over a real WebSocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.proto = ClientProtocol()
        self.round = 0

    @classmethod
    async def open(cls, url: str, api_key: str | None = None, fingerprint: str | None = None) -> AsyncSession:
        from websockets.asyncio.client import connect

        s = cls(await connect(url, max_size=None))
        await s.ws.send(
            s.proto.hello(Hello(vocab_fingerprint=fingerprint or tiny().vocab_fingerprint, api_key=api_key))
        )
        return s

    async def recv(self) -> Message:
        return self.proto.receive(await self.ws.recv())

    async def close(self) -> None:
        await self.ws.close()


async def run_greedy_async(
    sess: AsyncSession, prompt: list[int], n: int, seed: int, nodes: int = 8
) -> list[int]:
    rng = random.Random(seed)
    ref = prompt + reference(tuple(prompt), n)
    await sess.ws.send(
        sess.proto.prompt(
            Prompt(
                tokens=np.array(prompt),
                mode=Mode.GREEDY,
                max_new_tokens=n,
                tree=scripted_tree(rng, prompt, ref, nodes),
            )
        )
    )
    out: list[int] = []
    while True:
        msg = await sess.recv()
        if isinstance(msg, Error):
            raise AssertionError(f"unexpected error {msg}")
        if not isinstance(msg, Verdict):
            continue
        out.extend(msg.tokens.tolist())
        if msg.done:
            return out
        sess.round += 1
        await sess.ws.send(
            sess.proto.tree(Tree(sess.round, scripted_tree(rng, list(sess.proto.committed), ref, nodes)))
        )


async def collect_verdicts(sess: AsyncSession) -> list[int]:
    """Read verdicts until the done one; the generation's tokens (stale frames skipped)."""
    out: list[int] = []
    while True:
        v = await sess.recv()
        if isinstance(v, Stale):
            continue
        assert isinstance(v, Verdict), v
        out.extend(v.tokens.tolist())
        if v.done:
            return out
