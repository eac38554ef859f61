"""A long prefill beside a running generation: does chunking keep decoding going?

    python -m bench prefill_share --model smollm2-135m --prefill 4095 --tokens 64 --chunks 64,512

For each `--prefill-chunk` value it starts `cloud-verifier serve` on one core and times a short
greedy `ar` generation (the "honest" session) three ways per repeat: alone, and started together
with a second session whose prompt is `--prefill` random tokens (one new token). The honest
tokens must be the same every time; what changes is how long the honest generation takes while
the long prompt is being prefilled. With small chunks the engine interleaves the honest session's
decode steps with the prefill's chunks; with chunks as large as the step's token budget (512)
each decode step waits behind a 512-row forward.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
from tqdm import tqdm

from bench.harness import Verifier, add_common_args, table
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.frames import i32
from bench.lib.runner import Result, UsageError


async def _generate(url: str, hello: bytes, prompt: Sequence[int], n: int) -> tuple[list[int], float]:
    """One `ar` generation; (tokens, seconds from sending the prompt to the last verdict)."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None) as ws:
        await ws.send(hello)
        await ws.recv()
        t0 = time.perf_counter()
        await ws.send(
            msgpack.packb({"type": "prompt", "tokens": i32(prompt), "mode": "ar", "max_new_tokens": n})
        )
        toks: list[int] = []
        while True:
            frame = await asyncio.wait_for(ws.recv(), 600)
            m = msgpack.unpackb(frame if isinstance(frame, bytes) else frame.encode())
            if m.get("type") == "error":
                raise RuntimeError(f"the verifier refused the generation: {m}")
            if m.get("type") != "verdict":
                continue
            toks += np.frombuffer(m["tokens"], "<i4").tolist()
            if m["done"]:
                return toks, time.perf_counter() - t0


async def _pair(
    url: str, hello: bytes, honest: Sequence[int], n: int, long_prompt: Sequence[int] | None
) -> tuple[list[int], float, float]:
    """(honest tokens, honest seconds, seconds of the long prompt's generation or 0)."""
    if long_prompt is None:
        return (*await _generate(url, hello, honest, n), 0.0)
    (toks, s), (_, p) = await asyncio.gather(
        _generate(url, hello, honest, n), _generate(url, hello, long_prompt, 1)
    )
    return toks, s, p


def run_chunk(a: argparse.Namespace, chunk: int, vocab: int, hello: bytes) -> dict[str, Any]:
    rng = random.Random(a.seed)
    honest = [rng.randrange(vocab) for _ in range(16)]
    v = Verifier(
        a.model,
        cores=(a.core,) if a.core >= 0 else (),
        threads=1,
        args=[
            "--prefill-chunk",
            str(chunk),
            "--no-measure-cost",
            "--max-context",
            str(a.prefill + 8),
            "--kv-blocks",  # room for both sessions whatever the pool's automatic size
            str(2 * ((a.prefill + a.tokens + 32) // 16 + 2)),
            "--block-size",
            "16",
        ],
    ).start()
    alone: list[float] = []
    shared: list[float] = []
    prefill: list[float] = []
    identical = True
    try:
        ref, _, _ = asyncio.run(_pair(v.url, hello, honest, a.tokens, None))  # warm-up
        for _ in tqdm(range(a.repeats), desc=f"chunk {chunk}", file=sys.stderr, disable=a.no_progress):
            toks, s, _ = asyncio.run(_pair(v.url, hello, honest, a.tokens, None))
            identical &= toks == ref
            alone.append(s)
            long_prompt = [rng.randrange(vocab) for _ in range(a.prefill)]
            toks, s, p = asyncio.run(_pair(v.url, hello, honest, a.tokens, long_prompt))
            identical &= toks == ref
            shared.append(s)
            prefill.append(p)
    finally:
        v.stop()
    m_alone, m_shared = statistics.median(alone), statistics.median(shared)
    return {
        "prefill_chunk": chunk,
        "alone_s": round(m_alone, 3),
        "beside_prefill_s": round(m_shared, 3),
        "slowdown": round(m_shared / m_alone, 2),
        "long_prompt_s": round(statistics.median(prefill), 3),
        "identical": identical,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(ap, model="smollm2-135m")
    ap.add_argument("--prefill", type=int, default=4095, help="tokens of the long prompt")
    ap.add_argument(
        "--chunks", default="64,512", help="comma-separated --prefill-chunk values of the verifier to compare"
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per chunk value (median)")
    ap.add_argument("--core", type=int, default=1, help="CPU core of the verifier (-1: not pinned)")
    add_common_args(
        ap,
        json=True,
        json_help="rows: one per chunk value",
        seed=0,
        seed_help="randomness of the prompts",
        tokens=64,
        tokens_help="new tokens of the honest generation",
        no_progress=True,
    )


def run(a: argparse.Namespace) -> Result:
    try:
        chunks = [int(c) for c in a.chunks.split(",") if c]
    except ValueError as exc:
        raise UsageError(f"--chunks: comma-separated integers, got {a.chunks!r}") from exc
    if not chunks or min(chunks) < 1 or a.prefill < 1 or a.tokens < 1 or a.repeats < 1:
        raise UsageError("--chunks, --prefill, --tokens and --repeats must be >= 1")
    from shared.model import load_target

    target = load_target(a.model, progress=False)
    hello = msgpack.packb({"type": "hello", "version": 1, "vocab_fingerprint": target.vocab_fingerprint})
    vocab = target.config.vocab_size
    del target
    rows = [run_chunk(a, c, vocab, hello) for c in chunks]
    keys = ["prefill_chunk", "alone_s", "beside_prefill_s", "slowdown", "long_prompt_s", "identical"]
    text = (
        f"{a.model}: a {a.tokens}-token ar generation alone and beside a {a.prefill}-token prefill "
        f"(verifier on one core, medians of {a.repeats})\n"
        + table([[r[k] for k in keys] for r in rows], keys)
    )
    return Result(rows, text, status=0 if all(r["identical"] for r in rows) else 1)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
