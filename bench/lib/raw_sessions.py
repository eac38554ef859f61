"""Sessions spoken in the raw protocol, with no drafting model in the client: the target's own
continuation (`ar_tokens`), a greedy session driven by scripted trees that times every round
(`timed_greedy`), and concurrent clients running sessions back to back (`ar`, or greedy with a
cheap proposer's trees), counting the tokens that arrive in a time window (`session_load`). What
they cost the client is little more than a frame's encoding and decoding, so that what they measure
is the verifier and whatever stands between it and the client (bench.serving.fleet).

With `direct`, a session asks for its verifier's own address (hello.features `session.direct`) and,
offered one (a fleet replica's), moves there as the edge client does: a second connection whose
hello names the session's resume token; the first stays open, idle, until the session ends."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.sync.client import ClientConnection, connect

from shared.messages import (
    FEATURE_DIRECT,
    FEATURE_RESUME,
    Error,
    Hello,
    Message,
    Mode,
    Prompt,
    Stale,
    Tree,
    Verdict,
    Welcome,
)
from shared.protocol import ClientProtocol
from shared.tree import TokenTree


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """`length` token ids drawn uniformly from [3, vocab) (past the usual special ids)."""
    return [rng.randrange(3, vocab) for _ in range(length)]


def scripted_tree(
    rng: random.Random, committed: Sequence[int], ref_full: Sequence[int], nodes: int, vocab: int
) -> TokenTree:
    """A tree of at most `nodes` nodes whose first branch follows the reference (`ref_full`: the
    prompt and the target's greedy continuation) for a random number of tokens and then errs, with
    two wrong sibling branches of ids below `vocab`: each round accepts some nodes, rejects others
    and adds the bonus."""
    base = len(committed)
    ahead = list(ref_full[base : base + nodes])
    good = rng.randint(0, len(ahead))
    seqs = [[*ahead[:good], rng.randrange(3, vocab)]]
    for _ in range(2):
        seqs.append(random_prompt(rng, rng.randint(1, 3), vocab))
    tree = TokenTree.from_sequences(seqs, base=base)
    keep = np.arange(min(tree.num_nodes, nodes))
    return TokenTree.build(tree.tokens[keep], tree.parents[keep], tree.base, tree.cond)


def _binary(data: str | bytes) -> bytes:
    if not isinstance(data, bytes):
        raise RuntimeError("the server sent a text frame; the protocol is binary")
    return data


def _recv(ws: ClientConnection, proto: ClientProtocol, timeout: float) -> Message:
    return proto.receive(_binary(ws.recv(timeout)))


MOVE = (FEATURE_RESUME, FEATURE_DIRECT)  # the features of a session that moves when offered


def _welcomed(msg: Message, url: str) -> Welcome:
    if not isinstance(msg, Welcome):
        raise RuntimeError(f"the verifier at {url} answered the hello with {msg}")
    return msg


def _moved(first: Welcome, msg: Message, url: str) -> None:
    """Check that the connection to `url` took the session of `first` over."""
    w = _welcomed(msg, url)
    if w.session_id != first.session_id:
        raise RuntimeError(f"the session did not move to {url}: welcomed as another session")


@contextlib.contextmanager
def _session(
    url: str, fingerprint: str, timeout: float, direct: bool = False
) -> Iterator[tuple[ClientConnection, ClientProtocol]]:
    """A welcomed session at `url` (moved to the verifier's own address where `direct` and offered):
    its connection and protocol; every connection is closed after."""
    features = MOVE if direct else ()
    with contextlib.ExitStack() as stack:
        ws = stack.enter_context(connect(url, max_size=None, open_timeout=timeout))
        proto = ClientProtocol()
        ws.send(proto.hello(Hello(vocab_fingerprint=fingerprint, features=features)))
        welcome = _welcomed(_recv(ws, proto, timeout), url)
        if direct and welcome.direct is not None and welcome.resume is not None:
            ws = stack.enter_context(connect(welcome.direct, max_size=None, open_timeout=timeout))
            proto = ClientProtocol()
            ws.send(
                proto.hello(Hello(vocab_fingerprint=fingerprint, features=features, resume=welcome.resume))
            )
            _moved(welcome, _recv(ws, proto, timeout), welcome.direct)
        yield ws, proto


@contextlib.asynccontextmanager
async def _async_session(
    url: str, fingerprint: str, direct: bool
) -> AsyncIterator[tuple[Any, ClientProtocol]]:
    """`_session` for an event loop (connections opened within 60 s, no timeout after)."""
    from websockets.asyncio.client import connect as aconnect

    features = MOVE if direct else ()
    async with contextlib.AsyncExitStack() as stack:
        ws = await stack.enter_async_context(aconnect(url, max_size=None, open_timeout=60))
        proto = ClientProtocol()
        await ws.send(proto.hello(Hello(vocab_fingerprint=fingerprint, features=features)))
        welcome = _welcomed(proto.receive(_binary(await ws.recv())), url)
        if direct and welcome.direct is not None and welcome.resume is not None:
            ws = await stack.enter_async_context(aconnect(welcome.direct, max_size=None, open_timeout=60))
            proto = ClientProtocol()
            hello = Hello(vocab_fingerprint=fingerprint, features=features, resume=welcome.resume)
            await ws.send(proto.hello(hello))
            _moved(welcome, proto.receive(_binary(await ws.recv())), welcome.direct)
        yield ws, proto


def _verdict(msg: Message) -> Verdict | None:
    """The verdict `msg` is, None for a stale notice; an error frame or anything else raises."""
    if isinstance(msg, Stale):
        return None
    if isinstance(msg, Error):
        raise RuntimeError(f"the verifier answered {msg.code.value} ({msg.field}): {msg.message}")
    if not isinstance(msg, Verdict):
        raise RuntimeError(f"expected a verdict, got {msg.TYPE.value}")
    return msg


def ar_tokens(url: str, fingerprint: str, prompt: list[int], n: int, timeout: float = 120.0) -> list[int]:
    """The target's greedy continuation of `prompt` (up to `n` tokens), as an `ar` session at `url`
    generates it."""
    out: list[int] = []
    with _session(url, fingerprint, timeout) as (ws, proto):
        ws.send(proto.prompt(Prompt(tokens=np.array(prompt), mode=Mode.AR, max_new_tokens=n)))
        while True:
            v = _verdict(_recv(ws, proto, timeout))
            if v is None:
                continue
            out.extend(v.tokens.tolist())
            if v.done:
                return out


def timed_greedy(
    url: str,
    fingerprint: str,
    prompt: list[int],
    reference: list[int],
    n: int,
    seed: int,
    vocab: int,
    nodes: int = 8,
    timeout: float = 120.0,
    direct: bool = False,
) -> tuple[list[int], list[float], float]:
    """One greedy generation of `n` tokens at `url` (moved to the verifier's own address where
    `direct`), each round's tree scripted (`scripted_tree`) from `reference` (the target's
    continuation of `prompt`, `ar_tokens`) and `seed`: its tokens, the seconds from each frame sent
    to its verdict, the prompt's round (which carries the prefill) first, and the seconds the
    session took to open (connect, hello, welcome, and the move). The same arguments send the same
    frames to any verifier of the same target."""
    rng = random.Random(seed)
    ref_full = prompt + reference
    out: list[int] = []
    rounds: list[float] = []
    opening = time.perf_counter()
    with _session(url, fingerprint, timeout, direct) as (ws, proto):
        opened = time.perf_counter() - opening
        first = scripted_tree(rng, prompt, ref_full, nodes, vocab)
        sent = time.perf_counter()
        ws.send(proto.prompt(Prompt(tokens=np.array(prompt), mode=Mode.GREEDY, max_new_tokens=n, tree=first)))
        round_id = 0
        while True:
            v = _verdict(_recv(ws, proto, timeout))
            if v is None:
                continue
            rounds.append(time.perf_counter() - sent)
            out.extend(v.tokens.tolist())
            if v.done:
                return out, rounds, opened
            round_id = max(round_id, proto.last_round) + 1
            tree = scripted_tree(rng, proto.committed, ref_full, nodes, vocab)
            sent = time.perf_counter()
            ws.send(proto.tree(Tree(round_id, tree)))


@dataclass
class LoadTally:
    """What `ar_load`'s clients got: tokens in verdicts that arrived inside the window, sessions
    that ended inside it, and failures (a session that failed is started again)."""

    tokens: int = 0
    sessions: int = 0
    errors: list[str] = field(default_factory=list)


# a tree for the round after the committed tokens (prompt included): what a load client drafts
Proposer = Callable[[Sequence[int]], TokenTree]


async def _load_client(
    url: str,
    fingerprint: str,
    prompts: random.Random,
    vocab: int,
    n: int,
    propose: Proposer | None,
    window: tuple[float, float],
    tally: LoadTally,
    direct: bool = False,
) -> None:
    """Sessions back to back, one connection each (two where `direct` moves them), until the window
    (loop times) ends: greedy with `propose`'s tree each round, or `ar` without one."""
    loop = asyncio.get_running_loop()
    start, end = window
    while loop.time() < end:
        try:
            async with _async_session(url, fingerprint, direct) as (ws, proto):
                prompt = random_prompt(prompts, 16, vocab)
                first = Prompt(
                    tokens=np.array(prompt),
                    mode=Mode.AR if propose is None else Mode.GREEDY,
                    max_new_tokens=n,
                    tree=None if propose is None else propose(prompt),
                )
                await ws.send(proto.prompt(first))
                while True:
                    left = end - loop.time()
                    if left <= 0:
                        return
                    try:
                        data = await asyncio.wait_for(ws.recv(), left)
                    except TimeoutError:
                        return
                    v = _verdict(proto.receive(_binary(data)))
                    if v is None:
                        continue
                    now = loop.time()
                    if now >= start:
                        tally.tokens += len(v.tokens)
                    if v.done:
                        tally.sessions += now >= start
                        break
                    if propose is not None:
                        await ws.send(proto.tree(Tree(proto.last_round + 1, propose(proto.committed))))
        except Exception as exc:  # a refused or dropped session: count it and start another
            tally.errors.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.1)


async def session_load(
    url: str | Sequence[str],
    fingerprint: str,
    clients: int,
    n: int,
    window: tuple[float, float],
    seed: int,
    vocab: int,
    propose: Proposer | None = None,
    tick: Callable[[float, LoadTally], None] | None = None,
    direct: bool = False,
) -> LoadTally:
    """`clients` concurrent clients, each running sessions of `n` tokens back to back on random
    prompts (seeded), greedy with `propose`'s trees or `ar` (None), from now until `window`
    (warm-up seconds, measured seconds) has passed; tallies what arrived in the measured seconds.
    `tick(seconds into the measured window, tally)` is called twice a second (a progress bar).
    `direct`: each session moves to its verifier's own address where offered. Several URLs
    (verifiers of one target): client i runs its sessions on the i-th, in turn."""
    urls = [url] if isinstance(url, str) else list(url)
    loop = asyncio.get_running_loop()
    start = loop.time() + window[0]
    end = start + window[1]
    tally = LoadTally()
    rngs = [random.Random(seed * 1000 + i) for i in range(clients)]
    clients_done = asyncio.gather(
        *(
            _load_client(urls[i % len(urls)], fingerprint, r, vocab, n, propose, (start, end), tally, direct)
            for i, r in enumerate(rngs)
        )
    )
    while tick is not None and not clients_done.done():
        tick(loop.time() - start, tally)
        await asyncio.wait([clients_done], timeout=0.5)
    await clients_done
    return tally
