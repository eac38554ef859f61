"""A blocking session client for the fleet's tests and measurement: one greedy generation driven
by the scripted tree proposer of the service tests, over a real WebSocket, timing every round."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import numpy as np
from websockets.sync.client import ClientConnection, connect

from shared.messages import Error, Hello, Mode, Prompt, Stale, Tree, Verdict, Welcome
from shared.protocol import ClientProtocol
from tests.cloud_verifier.service import reference, scripted_tree, tiny


def greedy_session(
    url: str,
    prompt: list[int],
    n: int,
    seed: int,
    nodes: int = 8,
    timeout: float = 120.0,
    on_welcome: Callable[[], None] | None = None,
) -> tuple[list[int], list[float]]:
    """One greedy generation of `n` tokens on `tiny` at `url`: (its tokens, seconds from each
    frame sent to its verdict, the prompt's round first). `on_welcome` runs once the session is
    welcomed, before the prompt is sent."""
    rng = random.Random(seed)
    ref = prompt + reference(tuple(prompt), n)
    proto = ClientProtocol()
    out: list[int] = []
    rounds: list[float] = []
    with connect(url, max_size=None, open_timeout=timeout) as ws:
        ws.send(proto.hello(Hello(vocab_fingerprint=tiny().vocab_fingerprint)))
        welcome = proto.receive(_recv(ws, timeout))
        assert isinstance(welcome, Welcome), welcome
        if on_welcome is not None:
            on_welcome()
        first = scripted_tree(rng, prompt, ref, nodes)
        sent = time.perf_counter()
        ws.send(proto.prompt(Prompt(tokens=np.array(prompt), mode=Mode.GREEDY, max_new_tokens=n, tree=first)))
        round_id = 0
        while True:
            msg = proto.receive(_recv(ws, timeout))
            if isinstance(msg, Stale):
                continue
            if isinstance(msg, Error):
                raise AssertionError(f"unexpected error {msg}")
            assert isinstance(msg, Verdict), msg
            rounds.append(time.perf_counter() - sent)
            out.extend(msg.tokens.tolist())
            if msg.done:
                return out, rounds
            round_id = max(round_id, proto.last_round) + 1
            tree = scripted_tree(rng, list(proto.committed), ref, nodes)
            sent = time.perf_counter()
            ws.send(proto.tree(Tree(round_id, tree)))


def _recv(ws: ClientConnection, timeout: float) -> bytes:
    data = ws.recv(timeout)
    assert isinstance(data, bytes), data  # the protocol's frames are binary
    return data
