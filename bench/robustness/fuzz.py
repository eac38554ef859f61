"""Fuzz a live verifier with hostile frames; count crashes and over-limit frames it accepted.

    python -m bench fuzz --frames 1000000 --seconds 900 --json bench/out/fuzz.json

Starts `cloud-verifier serve --model tiny` in its own process (no frame-rate limit, so the fuzzer is
not slowed down; or `--url` for a running one) and drives `--connections` sessions at once. Each
sends a stream of frames: valid prompts and trees mutated (bytes flipped, cut short, lengths
inflated, fields replaced by values of every type and edge value), random msgpack, and frames
deliberately over each advertised limit (nodes, depth, cond, draws, frame size). A connection the
server closes is reopened. Every `--check-every` frames one over-limit frame is sent and its reply
awaited: it must be an error or a close, never a verdict. At the end the server must still be alive
and ready and an honest greedy session must emit exactly the tokens of target-only decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
from tqdm import tqdm

from bench.harness import Verifier, add_common_args, figure_rows, table
from bench.lib import runner
from bench.lib.frames import honest_generation, i32, recv
from bench.lib.runner import Result, UsageError

EDGE_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, -(2**31) - 1, 2**63, -(2**63), 2**64 - 1, 0.0, -0.0, 1e308,
    float("inf"), float("-inf"), float("nan"), 1e-300, "", "x" * 5000, b"", b"\xff" * 7, [], [1] * 50, {},
    {"a": 1}, "greedy", "rrs", "mss", "ar",
]  # fmt: skip


@dataclass
class Fuzzer:
    rng: random.Random
    vocab: int
    limits: dict[str, int]
    committed: int = 8

    # ---------------------------------------------------------------- valid frames to start from
    def prompt(self) -> dict[str, Any]:
        n = self.rng.randint(1, 12)
        return {
            "type": "prompt",
            "tokens": i32([self.rng.randrange(self.vocab) for _ in range(n)]),
            "mode": self.rng.choice(["greedy", "match", "ar", "mss", "rrs"]),
            "temperature": self.rng.choice([0.0, 0.7, 1.0, 1e-300, 1e4]),
            "top_k": self.rng.choice([0, 1, 50]),
            "top_p": self.rng.choice([1.0, 0.5, 1e-9]),
            "seed": self.rng.randrange(2**63),
            "max_new_tokens": self.rng.choice([1, 8, 4096]),
            "stop_ids": b"",
            "continue": False,
        }

    def tree(self, n: int | None = None, depth_chain: bool = False) -> dict[str, Any]:
        n = n if n is not None else self.rng.randint(1, 12)
        parents = list(range(-1, n - 1)) if depth_chain else [self.rng.randint(-1, i - 1) for i in range(n)]
        return {
            "type": "tree",
            "round": self.rng.randint(1, 10**6),
            "base": self.committed,
            "cond": b"",
            "tokens": i32(self.rng.sample(range(self.vocab), n)),
            "parents": i32(parents),
        }

    # ---------------------------------------------------------------- hostile frames
    def over_limit(self) -> tuple[str, int | None, bytes]:
        """A frame over one advertised limit (its kind, its round): the server must refuse it."""
        lim = self.limits
        kind = self.rng.choice(["nodes", "depth", "cond", "frame", "draws"])
        if kind == "nodes":
            d = self.tree(lim["max_nodes"] + 1)
            d["parents"] = i32([-1] * (lim["max_nodes"] + 1))
        elif kind == "depth":
            d = self.tree(lim["max_depth"] + 1, depth_chain=True)
        elif kind == "cond":
            d = self.tree(1)
            c = 4 * (lim["max_depth"] + 1) + 1
            d["cond"], d["base"] = i32([7] * c), max(self.committed - c, 0)
        elif kind == "draws":
            d = self.tree(1)
            k = lim.get("max_draws", 256) + 1
            d["draws"] = {
                "node": i32([0] * k),
                "drafter": bytes(k),
                "qrow": i32([0] * k),
                "q_ptr": np.asarray([0, 1], "<u4").tobytes(),
                "q_ids": i32([int(np.frombuffer(d["tokens"], "<i4")[0])]),
                "q_wm1": np.asarray([65535], "<u2").tobytes(),
            }
        else:
            return kind, None, msgpack.packb({"type": "tree", "pad": b"\0" * (lim["max_bytes"] + 1)})
        return kind, int(d["round"]), msgpack.packb(d, use_bin_type=True)

    def mutate(self) -> bytes:
        r = self.rng
        makers: list[Callable[[], dict[str, Any]]] = [
            self.prompt,
            self.tree,
            lambda: {"type": "cancel"},
            lambda: {"type": "close"},
        ]
        base = r.choice(makers)()
        how = r.randrange(6)
        if how == 0 and base:  # a field replaced by an edge value of any type
            k = r.choice(list(base))
            base[k] = r.choice(EDGE_VALUES)
        elif how == 1:  # an unknown or missing field
            if r.random() < 0.5:
                base[r.choice(["x", "tokens2", "ROUND", ""])] = r.choice(EDGE_VALUES)
            elif len(base) > 1:
                base.pop(r.choice([k for k in base if k != "type"]))
        raw = bytearray(msgpack.packb(base, use_bin_type=True))
        if how == 2:  # bytes flipped
            for _ in range(r.randint(1, 8)):
                raw[r.randrange(len(raw))] = r.randrange(256)
        elif how == 3:  # cut short, or trailing garbage
            raw = (
                raw[: r.randrange(len(raw))]
                if r.random() < 0.5
                else raw + bytes(r.randrange(256) for _ in range(4))
            )
        elif how == 4:  # a length header inflated (str32 / bin32 / array32 / map32)
            raw = bytearray(bytes([r.choice([0xDB, 0xC6, 0xDD, 0xDF])]) + b"\xff\xff\xff\xf0") + raw
        elif how == 5:  # random structures, deep nesting, extension types
            junk = bytes(r.randrange(256) for _ in range(r.randint(1, 64)))
            raw = bytearray(r.choice([b"\x91" * r.randint(10, 5000) + b"\xc0", b"\xd4\x01\x00", junk]))
        return bytes(raw)


@dataclass
class Tally:
    frames: int = 0
    bytes: int = 0
    closes: Counter[int] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)
    over_limit_sent: int = 0
    over_limit_accepted: int = 0
    accepted_kinds: Counter[str] = field(default_factory=Counter)


async def _connection(
    url: str, fz: Fuzzer, tally: Tally, hello: bytes, stop: Callable[[], bool], check_every: int, bar: Any
) -> None:
    from websockets.asyncio.client import connect

    while not stop():
        try:
            ws = await connect(url, max_size=None, open_timeout=10)
        except Exception:
            await asyncio.sleep(0.2)
            continue
        try:
            await ws.send(hello)
            w = await recv(ws, 10)
            if w.get("type") != "welcome":
                tally.replies[f"hello->{w.get('type')}"] += 1
                await asyncio.sleep(0.1)
                continue
            # a real generation half the time, so tree frames meet a generating session
            if fz.rng.random() < 0.5:
                p = fz.prompt()
                p["mode"], p["max_new_tokens"] = "greedy", 4096
                await ws.send(msgpack.packb(p, use_bin_type=True))
            while not stop():
                if tally.frames % check_every == 0:
                    kind, rnd, frame = fz.over_limit()
                    tally.over_limit_sent += 1
                    await ws.send(frame)
                    tally.frames += 1
                    bar.update()
                    if await _accepted(ws, tally, rnd):
                        tally.over_limit_accepted += 1
                        tally.accepted_kinds[kind] += 1
                    continue
                frame = fz.mutate()
                await ws.send(frame)
                tally.frames += 1
                tally.bytes += len(frame)
                bar.update()
                while True:  # read whatever replies are there, without waiting
                    try:
                        msg = await recv(ws, 0.0005)
                    except TimeoutError:
                        break
                    tally.replies[str(msg.get("type"))] += 1
        except Exception as exc:
            rcvd = getattr(exc, "rcvd", None)
            tally.closes[rcvd.code if rcvd is not None else 0] += 1
        finally:
            await ws.close()


async def _accepted(ws: Any, tally: Tally, rnd: int | None) -> bool:
    """Wait for the reply to an over-limit frame of round `rnd`: True if the server verified it (a
    verdict of that round). An error for it, or a close, is a refusal."""
    deadline = time.monotonic() + 5
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = await recv(ws, left)  # a close raises: refused
        except TimeoutError:
            break
        kind = str(msg.get("type"))
        tally.replies[kind] += 1
        if msg.get("round") == rnd and kind in ("error", "stale"):
            return False
        if kind == "verdict" and rnd is not None and msg.get("round") == rnd:
            return True
    return False


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--frames", type=int, default=100_000, help="stop after this many frames")
    ap.add_argument("--seconds", type=float, default=120.0, help="stop after this long, whichever first")
    ap.add_argument("--connections", type=int, default=8, help="concurrent fuzzing connections")
    ap.add_argument("--check-every", type=int, default=200, help="send one over-limit frame every N frames")
    ap.add_argument("--url", default=None, help="fuzz a running verifier (ws://...) instead of starting one")
    add_common_args(
        ap,
        json=True,
        json_help="the figures (rows: one {figure, value} each)",
        seed=0,
        seed_help="randomness of the frames",
        no_progress=True,
    )


def start_verifier(connections: int) -> Verifier:
    """`cloud-verifier serve --model tiny` for `connections` fuzzing connections, with no frame-rate
    limit (the fuzzer is not slowed down)."""
    return Verifier(
        "tiny",
        threads=1,
        args=[
            "--no-measure-cost",
            "--frames-per-s",
            "0",
            "--max-sessions",
            str(connections + 4),
            "--max-handshakes",
            str(4 * connections),
            "--hello-timeout",
            "30",
        ],
    ).start()


async def fuzz(
    url: str,
    hello: bytes,
    vocab: int,
    tally: Tally,
    t0: float,
    *,
    frames: int,
    seconds: float,
    connections: int,
    check_every: int,
    seed: int,
    progress: bool,
) -> tuple[list[int], list[int]]:
    """`connections` fuzzing connections until `frames` frames are sent or `seconds` have passed
    since `t0`, then an honest greedy session and its `ar` run: (the honest tokens, ar's tokens)."""
    from websockets.asyncio.client import connect

    async with connect(url) as ws:
        await ws.send(hello)
        limits = (await recv(ws, 30))["limits"]
    stop = lambda: tally.frames >= frames or time.monotonic() - t0 > seconds  # noqa: E731
    with tqdm(total=frames, desc="fuzz frames", file=sys.stderr, mininterval=2, disable=not progress) as bar:
        await asyncio.gather(
            *(
                _connection(
                    url,
                    Fuzzer(random.Random(seed * 1000 + i), vocab, limits),
                    tally,
                    hello,
                    stop,
                    check_every,
                    bar,
                )
                for i in range(connections)
            )
        )
    prompt = [5, 6, 7, 8, 9]
    return await honest_generation(url, hello, prompt, 24)


def figures(
    tally: Tally, elapsed: float, connections: int, alive: bool, ready: bool, honest_identical: bool
) -> dict[str, Any]:
    """The printed table's figures: frames and their rate, crashes (the server dead, not ready),
    the over-limit frames sent and accepted, closes and replies by kind, the honest session."""
    return {
        "frames": tally.frames,
        "seconds": round(elapsed, 1),
        "frames_per_s": round(tally.frames / elapsed, 1),
        "connections": connections,
        "crashes": int(not alive) + int(not ready),
        "server_alive": alive,
        "ready_after": ready,
        "over_limit_sent": tally.over_limit_sent,
        "over_limit_accepted": tally.over_limit_accepted,
        "accepted_kinds": dict(tally.accepted_kinds),
        "closes": {str(k): v for k, v in sorted(tally.closes.items())},
        "replies": dict(tally.replies),
        "honest_identical_to_ar": honest_identical,
    }


def render_table(result: dict[str, Any]) -> str:
    """The figures as the printed table (a figure that is a mapping as its JSON text)."""
    return table(
        [[k, json.dumps(v) if isinstance(v, dict) else v] for k, v in result.items()],
        ["figure", "value"],
    )


def run(a: argparse.Namespace) -> Result:
    if a.frames < 1 or a.seconds <= 0 or a.connections < 1 or a.check_every < 1:
        raise UsageError("--frames, --seconds, --connections and --check-every must be positive")
    verifier = None
    if a.url is None:
        verifier = start_verifier(a.connections)
        url = verifier.url
    else:
        url = a.url
    http = url.replace("ws://", "http://").split("/v1/")[0]
    import httpx

    from shared.model import load_target

    tiny = load_target("tiny", progress=False)
    hello = msgpack.packb({"type": "hello", "version": 1, "vocab_fingerprint": tiny.vocab_fingerprint})
    tally = Tally()
    t0 = time.monotonic()
    try:
        honest, ar = asyncio.run(
            fuzz(
                url,
                hello,
                tiny.config.vocab_size,
                tally,
                t0,
                frames=a.frames,
                seconds=a.seconds,
                connections=a.connections,
                check_every=a.check_every,
                seed=a.seed,
                progress=not a.no_progress,
            )
        )
        elapsed = time.monotonic() - t0
        alive = verifier is None or (verifier.proc is not None and verifier.proc.poll() is None)
        ready = httpx.get(http + "/readyz", timeout=10).status_code == 200
    finally:
        if verifier is not None:
            verifier.stop()
    result = figures(tally, elapsed, a.connections, alive, ready, honest == ar)
    crashes: int = result["crashes"]
    ok = crashes == 0 and tally.over_limit_accepted == 0 and honest == ar
    verdict = "ok" if ok else "FAILED"
    line = f"fuzz: {verdict}: {crashes} crashes, {tally.over_limit_accepted} over-limit frames accepted"
    return Result(figure_rows(result), f"{render_table(result)}\n{line}", extra=result, status=0 if ok else 1)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
