"""Recorded generations and their replay: every frame an edge client sent, cued by the verdicts it
had taken up, played back to a verifier with no drafter running.

bench.serving.load --cloud-cost records once and replays with M clients (the cloud's cost at saturation);
bench.end_to_end.network --idle-replay replays each tree mode's generations once, right after the block, to
measure the verifier's time for the same rounds with the edge idle."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.messages import Cancel, Error, Mode, Prompt, Tree, Verdict, decode, encode
from shared.wire import DEFAULT_WIRE_LIMITS


@dataclass(frozen=True)
class Step:
    """One frame a client sends: once `after` verdicts of the generation have arrived, `delay_s`
    after the last of them (after = 0: after the generation's prompt left)."""

    frame: bytes
    after: int
    delay_s: float


@dataclass
class Script:
    """One recorded generation: what the client sent, and the tokens the verifier answered."""

    prompt_index: int
    steps: list[Step]
    tokens: list[int]  # every verdict's tokens, in order
    verdicts: list[tuple[int, int]] = field(default_factory=list)  # (round, tokens) of each verdict
    ms_per_token: float = 0.0  # as recorded (one client, the edge drafting)

    def as_ar(self) -> Script:
        """The same prompt for a cloud-only client: mode ar, no tree, nothing sent after it."""
        first = decode(self.steps[0].frame)
        if not isinstance(first, Prompt):
            raise ValueError("a script starts with its prompt frame")
        prompt = dataclasses.replace(first, mode=Mode.AR, tree=None)
        return Script(
            self.prompt_index, [Step(encode(prompt), 0, 0.0)], list(self.tokens), [(0, 1)] * len(self.tokens)
        )


class RecordingTransport:
    """A transport that logs every frame with its time (out: as it leaves, in: as it arrives),
    under the link shaper, so the delays between frames include the round trip."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.log: list[tuple[str, float, bytes]] = []

    async def send(self, data: bytes) -> None:
        self.log.append(("out", time.monotonic(), data))
        await self.inner.send(data)

    async def recv(self) -> bytes:
        data: bytes = await self.inner.recv()
        self.log.append(("in", time.monotonic(), data))
        return data

    async def close(self) -> None:
        await self.inner.close()


def script_from_log(log: Sequence[tuple[str, float, bytes]], prompt_index: int) -> Script:
    """The script of the one generation in `log` (frames before its prompt are ignored)."""
    steps: list[Step] = []
    tokens: list[int] = []
    rounds: list[tuple[int, int]] = []
    verdicts = 0
    last = 0.0
    started = False
    for direction, t, data in log:
        msg = decode(data, DEFAULT_WIRE_LIMITS)
        if direction == "out":
            if isinstance(msg, Prompt):
                if started:
                    raise ValueError("two prompts in one generation's log")
                started, last = True, t
            if not started or not isinstance(msg, Prompt | Tree):
                continue
            steps.append(Step(data, verdicts, max(0.0, t - last)))
        elif started and isinstance(msg, Verdict):
            tokens += [int(x) for x in msg.tokens]
            rounds.append((msg.round, len(msg.tokens)))
            verdicts += 1
            last = t
            if msg.done:
                break
    if not steps:
        raise ValueError("no prompt in the generation's log")
    return Script(prompt_index, steps, tokens, rounds)


@dataclass
class Tally:
    """What the clients of one run received inside the measured window."""

    start: float = 0.0
    end: float = 0.0
    tokens: list[int] = field(default_factory=list)  # per client
    generations: int = 0
    diverged: int = 0
    errors: list[str] = field(default_factory=list)
    verify_ms: list[float] = field(default_factory=list)  # rounds after each generation's first

    def count(self, client: int, n: int) -> bool:
        if self.start <= time.monotonic() <= self.end:
            self.tokens[client] += n
            return True
        return False


def renumbered(script: Script, base: int) -> tuple[list[bytes], int]:
    """The script's frames with its tree rounds moved above `base` (a session's rounds only grow,
    and a replay client plays many generations on one session); and the last round used."""
    rounds = [m.round for m in map(decode, (st.frame for st in script.steps)) if isinstance(m, Tree)]
    shift = base + 1 - min(rounds) if rounds else 0
    frames = []
    for st in script.steps:
        msg = decode(st.frame)
        frames.append(
            encode(dataclasses.replace(msg, round=msg.round + shift)) if isinstance(msg, Tree) else st.frame
        )
    return frames, max(rounds) + shift if rounds else base


async def play(
    ws: Any, script: Script, frames: Sequence[bytes], client: int, tally: Tally, deadline: float
) -> None:
    """One generation: send the script's frames on their cue, take the verdicts, check them."""
    arrived: list[float] = [time.monotonic()]  # the prompt's send, then each verdict's arrival
    cue = asyncio.Event()

    async def sender() -> None:
        for step, frame in zip(script.steps, frames, strict=True):
            while len(arrived) <= step.after:
                cue.clear()
                await cue.wait()
            wait = arrived[step.after] + step.delay_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await ws.send(frame)

    task = asyncio.create_task(sender())
    got = 0
    cancelled = False
    try:
        while time.monotonic() < deadline:
            try:
                msg = decode(await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                return
            if isinstance(msg, Error):
                tally.errors.append(f"{msg.code.value}: {msg.message}")
                if msg.fatal:
                    raise RuntimeError(f"the verifier closed a replay session: {msg.message}")
                continue
            if not isinstance(msg, Verdict):
                continue  # stale notices: a pre-speculated tree the outcome ruled out
            new = [int(x) for x in msg.tokens]
            if not cancelled and new != script.tokens[got : got + len(new)]:
                tally.diverged += 1
                cancelled = True
                task.cancel()
                await ws.send(encode(Cancel()))
            got += len(new)
            if tally.count(client, len(new)) and len(arrived) > 1:  # the first round holds the prefill
                tally.verify_ms.append(msg.verify_ms)
            arrived.append(time.monotonic())
            cue.set()
            if msg.done:
                if not cancelled:
                    tally.generations += 1
                return
    finally:
        task.cancel()


def eager(script: Script) -> Script:
    """The same script with every frame sent as soon as its verdicts are in (no drafting, no round
    trip between them): the verifier's time a round is what a replay of it measures."""
    return dataclasses.replace(script, steps=[dataclasses.replace(st, delay_s=0.0) for st in script.steps])


async def replay_once(ws: Any, hello: bytes, scripts: Sequence[Script], limit_s: float = 3600.0) -> Tally:
    """Each script once, in order, on one session of the open WebSocket `ws` (eagerly: `eager`); the
    tally's verify_ms has every round's verify ms after each generation's first (the prompt's round,
    which holds the prefill, is left out as in bench.end_to_end.network's V)."""
    await ws.send(hello)
    welcome = decode(await ws.recv())
    if isinstance(welcome, Error):
        raise RuntimeError(f"the verifier refused the replay client: {welcome.message}")
    now = time.monotonic()
    tally = Tally(start=now, end=now + limit_s, tokens=[0])
    last_round = 0
    for script in scripts:
        fast = eager(script)
        frames, last_round = renumbered(fast, last_round)
        await play(ws, fast, frames, 0, tally, tally.end)
    return tally


def last_prompt(log: Sequence[tuple[str, float, bytes]]) -> int:
    """The index in `log` of the last prompt frame sent (0 when there is none)."""
    for i in range(len(log) - 1, -1, -1):
        direction, _, data = log[i]
        if direction == "out" and isinstance(decode(data, DEFAULT_WIRE_LIMITS), Prompt):
            return i
    return 0


class Recorders:
    """Recording transports for the edge clients of one block, by mode: `factory(mode)` is an
    EdgeClient transport factory, and `cut(mode, index)` after each generation turns the frames of
    the one that just ended into a Script (a generation the client reconnected in is counted in
    `lost`, not scripted)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url
        self.api_key = api_key
        self.transports: dict[str, list[RecordingTransport]] = {}
        self.scripts: dict[str, list[Script]] = {}
        self.lost: dict[str, int] = {}

    def factory(self, mode: str) -> Callable[[], Awaitable[RecordingTransport]]:
        async def make() -> RecordingTransport:
            from edge_client.transports import WebSocketTransport

            r = RecordingTransport(await WebSocketTransport.connect(self.url, api_key=self.api_key))
            self.transports.setdefault(mode, []).append(r)
            return r

        return make

    def cut(self, mode: str, index: int) -> None:
        log = self.transports[mode][-1].log
        try:
            script = script_from_log(log[last_prompt(log) :], index)
        except ValueError:
            self.lost[mode] = self.lost.get(mode, 0) + 1
            return
        self.scripts.setdefault(mode, []).append(script)

    def hello(self, mode: str) -> bytes:
        """The hello frame the mode's (last) session opened with."""
        return next(d for direction, _, d in self.transports[mode][-1].log if direction == "out")


async def replay_idle(rec: Recorders, modes: Sequence[str]) -> dict[str, Tally]:
    """Each of `modes`' recorded generations once, eagerly, on a session of its own, with nothing
    drafting (replay_once): the verifier's time for the same rounds with the edge idle."""
    from edge_client.transports import WebSocketTransport

    out: dict[str, Tally] = {}
    for mode in modes:
        if not rec.scripts.get(mode):
            continue
        ws = await WebSocketTransport.connect(rec.url, api_key=rec.api_key)
        try:
            out[mode] = await replay_once(ws, rec.hello(mode), rec.scripts[mode])
        finally:
            await ws.close()
    return out
