"""bench.serving.load's edge sessions: the prompts they cycle through and the concurrent clients that drive
the verifier (each one a real session over a WebSocket, tallied into `Tally`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.harness import DATA
from bench.serving.load_figures import Tally
from bench.serving.proposer import LookupConfig, propose
from shared.errors import ErrorCode
from shared.messages import Error, Hello, Mode, Prompt, Stale, Tree, Verdict, Welcome
from shared.model import TargetTokenizer
from shared.protocol import ClientProtocol

PROMPTS = DATA
PROMPT_FILE = "spec_bench_dev.jsonl"
# a refused hello will be refused again: stop the run instead of reconnecting in a loop
FATAL_AT_HELLO = (ErrorCode.VOCAB_MISMATCH, ErrorCode.UNAUTHORIZED, ErrorCode.BAD_VERSION)


class BenchError(RuntimeError):
    """The load cannot run at all (no prompts, a refused hello, a server that never got ready)."""


# --------------------------------------------------------------------------------------- prompts
def load_tokenizer(model: str) -> TargetTokenizer:
    """The tokenizer of `model` without loading its weights (for `--url`, where the server has them)."""
    from shared import model_store
    from shared.model import gguf_loader, safetensors_loader

    alias = "smollm2-135m" if model == "tiny" else model
    path = model_store.resolve(alias, "target") if alias in model_store.ALIASES else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_loader.tokenizer_from_gguf(gguf_loader.open_gguf(path), path)
    if path.is_dir():
        return safetensors_loader.tokenizer_from_dir(path, safetensors_loader.config_from_dir(path))
    raise BenchError(f"{model!r} is not an alias, a .gguf file or a model directory")


def load_prompts(
    tokenizer: TargetTokenizer, folder: Path, count: int, max_tokens: int, seed: int
) -> list[list[int]]:
    """First turns of the Spec-Bench dev prompts, chat-templated and encoded, in a seeded order
    (the file is grouped by category; shuffling gives every run the same mix from its start)."""
    path = folder / PROMPT_FILE
    if not path.is_file():
        raise BenchError(f"no prompt file at {path}")
    prompts: list[list[int]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        text = json.loads(line)["turns"][0]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        ids = tokenizer.encode(text)
        if len(ids) <= max_tokens:
            prompts.append(ids)
    if not prompts:
        raise BenchError(f"no prompt in {path} is within {max_tokens} tokens")
    random.Random(seed).shuffle(prompts)
    return prompts[:count] if count > 0 else prompts


class PromptCycle:
    """Hands prompts out in order, round robin over every client of a run (single event loop)."""

    def __init__(self, prompts: Sequence[list[int]]) -> None:
        self.prompts = prompts
        self.i = 0

    def next(self) -> list[int]:
        p = self.prompts[self.i % len(self.prompts)]
        self.i += 1
        return p


# --------------------------------------------------------------------------------------- clients
@dataclass(frozen=True)
class LoadSpec:
    """What every client of a run does."""

    fingerprint: str
    lookup: LookupConfig
    tokens: int  # max_new_tokens per generation
    api_key: str | None = None


class _RoundFailed(Exception):
    """The server answered a round with an error: count it, reconnect, go on."""


def _frame(data: str | bytes) -> bytes:
    if isinstance(data, str):
        raise _RoundFailed("the server sent a text frame; the protocol is binary")
    return data


async def _connect(url: str, spec: LoadSpec) -> tuple[Any, ClientProtocol]:
    from websockets.asyncio.client import connect

    ws = await connect(url, max_size=None, open_timeout=30)
    proto = ClientProtocol()
    await ws.send(proto.hello(Hello(vocab_fingerprint=spec.fingerprint, api_key=spec.api_key)))
    reply = proto.receive(_frame(await ws.recv()))
    if isinstance(reply, Error) and reply.code in FATAL_AT_HELLO:
        await ws.close()
        raise BenchError(f"the verifier refused the session: {reply.code.value}: {reply.message}")
    if not isinstance(reply, Welcome):
        await ws.close()
        raise _RoundFailed(f"hello answered with {reply}")
    return ws, proto


def _lookup_for(spec: LoadSpec, welcome: Welcome | None) -> LookupConfig:
    """The proposer's tree within the server's advertised limits."""
    cfg = spec.lookup
    if welcome is None:
        return cfg
    lim = welcome.limits
    return replace(cfg, nodes=min(cfg.nodes, lim.max_nodes), depth=min(cfg.depth, lim.max_depth))


async def _generate(
    ws: Any, proto: ClientProtocol, spec: LoadSpec, prompts: PromptCycle, tally: Tally, deadline: float
) -> None:
    """Generations back to back on one connection until the deadline."""
    loop = asyncio.get_running_loop()
    lookup = _lookup_for(spec, proto.welcome_msg)
    while loop.time() < deadline:
        tokens = prompts.next()
        prompt = Prompt(
            tokens=np.asarray(tokens, dtype=np.int32),
            mode=Mode.GREEDY,
            max_new_tokens=spec.tokens,
            tree=propose(tokens, lookup),
        )
        sent = loop.time()
        await ws.send(proto.prompt(prompt))
        first = len(tokens)
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                msg = proto.receive(_frame(await asyncio.wait_for(ws.recv(), left)))
            except TimeoutError:
                return
            if isinstance(msg, Stale):
                continue
            if isinstance(msg, Error):
                raise _RoundFailed(f"{msg.code.value} ({msg.field}): {msg.message}")
            if not isinstance(msg, Verdict):
                raise _RoundFailed(f"unexpected {msg.TYPE.value}")
            tally.verdict((loop.time() - sent) * 1e3, len(msg.tokens), first)
            first = 0
            if msg.done:
                tally.sessions_completed += 1
                break
            tree = propose(proto.committed, lookup)
            sent = loop.time()
            await ws.send(proto.tree(Tree(proto.last_round + 1, tree)))


async def _client(
    url: str,
    spec: LoadSpec,
    prompts: PromptCycle,
    tally: Tally,
    conn: tuple[Any, ClientProtocol] | BaseException,
    deadline: float,
) -> None:
    """One client: its generations until the deadline, reconnecting after any failure."""
    loop = asyncio.get_running_loop()
    while True:
        if isinstance(conn, BenchError):
            raise conn
        if isinstance(conn, BaseException):
            tally.error(f"{type(conn).__name__}: {conn}")
            if loop.time() >= deadline:
                return
            await asyncio.sleep(0.1)  # do not spin on a server that refuses us
            try:
                conn = await _connect(url, spec)
            except Exception as exc:
                conn = exc
            continue
        ws, proto = conn
        try:
            await _generate(ws, proto, spec, prompts, tally, deadline)
            return
        except Exception as exc:  # a failed round or a dropped connection: count it, carry on
            conn = exc
        finally:
            with contextlib.suppress(Exception):
                await ws.close()


async def drive(
    url: str,
    spec: LoadSpec,
    prompts: Sequence[list[int]],
    clients: int,
    seconds: float,
    label: str,
    forwards: Callable[[], int] | None = None,
    progress: bool = True,
) -> tuple[Tally, int | None]:
    """Run `clients` concurrent clients for `seconds` (a progress bar on stderr unless not
    `progress`); returns the tally and the engine forwards in that time (when the bench owns the
    server)."""
    loop = asyncio.get_running_loop()
    conns = await asyncio.gather(*(_connect(url, spec) for _ in range(clients)), return_exceptions=True)
    for c in conns:
        if isinstance(c, BenchError):
            raise c
    tally = Tally()
    cycle = PromptCycle(prompts)
    f0 = forwards() if forwards else None
    start = loop.time()
    deadline = start + seconds
    with tqdm(
        total=seconds,
        desc=label,
        unit="s",
        bar_format="{desc}: {bar} {n:.0f}/{total:.0f} s{postfix}",
        disable=not progress,
    ) as bar:

        async def tick() -> None:
            while True:
                bar.n = min(loop.time() - start, seconds)
                bar.set_postfix_str(
                    f"{tally.tokens / max(bar.n, 1e-9):.1f} tok/s, {tally.sessions_completed} done, "
                    f"{tally.errors} errors"
                )
                await asyncio.sleep(0.5)

        ticker = asyncio.create_task(tick())
        try:
            await asyncio.gather(*(_client(url, spec, cycle, tally, c, deadline) for c in conns))
        finally:
            ticker.cancel()
        bar.n = seconds
        bar.refresh()
    done_forwards = forwards() - f0 if forwards and f0 is not None else None
    return tally, done_forwards
