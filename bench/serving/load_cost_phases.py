"""The two phases of bench.serving.load_cost over the wire: record (a real edge client generates every
prompt once through a transport that logs each frame: the generations' scripts) and replay (M frame
players send the scripts to the verifier as the edge did; the window's verifier-seconds per token
from its /metrics). bench/serving/load_cost.py's docstring has the method."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from bench.harness import BenchPrompt, read_metrics
from bench.lib.replay import Recorders, Script, Tally, play, renumbered
from bench.lib.stats import median
from shared.messages import Error, Mode, decode


# ----------------------------------------------------------------------------------- record
async def record(
    url: str,
    drafter: Any,
    prompts: Sequence[BenchPrompt],
    tokens: int,
    mode_name: str,
    tree_text: str,
    rtt_ms: float,
    temperature: float,
    progress: bool,
) -> tuple[bytes, list[Script]]:
    """Generate every prompt once with a real edge client in `mode_name`; its hello frame and the
    generations' scripts."""
    from bench.end_to_end.e2e import variants
    from bench.lib.shaper import LinkShape
    from edge_client.client import EdgeClient
    from shared.tree import ExpansionConfig

    v = variants([mode_name], ExpansionConfig.parse(tree_text))[mode_name]
    rec = Recorders(url)
    client = EdgeClient(
        url,
        drafter,
        tree=v.tree,
        prespec=v.prespec,
        link=LinkShape.rtt(rtt_ms),
        transport=rec.factory(mode_name),
    )
    await client.connect()
    args = v.generate_args(Mode.MATCH if temperature > 0 else Mode.GREEDY)
    try:
        async for _ in client.generate("Hello", max_new_tokens=4, temperature=temperature, **args):
            pass  # warm both sides up
        bar = tqdm(total=len(prompts), desc=f"record {mode_name}", disable=not progress, file=sys.stderr)
        for i, p in enumerate(prompts):
            async for _ in client.generate(
                p.text, raw=p.raw, max_new_tokens=tokens, temperature=temperature, seed=i, **args
            ):
                pass
            rec.cut(mode_name, i)
            if rec.lost:
                raise RuntimeError("the edge reconnected while recording; rerun the bench")
            gen = client.last
            assert gen is not None
            rec.scripts[mode_name][-1].ms_per_token = gen.stats.ms_per_token
            bar.update(1)
        bar.close()
        hello = rec.hello(mode_name)
    finally:
        await client.close()
    return hello, rec.scripts.get(mode_name, [])


# ----------------------------------------------------------------------------------- replay
async def client_loop(
    url: str, hello: bytes, scripts: Sequence[Script], client: int, offset: int, tally: Tally
) -> None:
    from edge_client.transports import WebSocketTransport

    ws = await WebSocketTransport.connect(url)
    try:
        await ws.send(hello)
        welcome = decode(await ws.recv())
        if isinstance(welcome, Error):
            raise RuntimeError(f"the verifier refused a replay client: {welcome.message}")
        i, last_round = offset, 0
        while time.monotonic() < tally.end:
            script = scripts[i % len(scripts)]
            frames, last_round = renumbered(script, last_round)
            await play(ws, script, frames, client, tally, tally.end)
            i += 1
    finally:
        await ws.close()


def scrape(http: str) -> tuple[float, float]:
    """(forward seconds, forwards) of the verifier at `http` so far."""
    m = read_metrics(http)
    return m.get("specdec_verify_forward_seconds_sum", 0.0), m.get(
        "specdec_verify_forward_seconds_count", 0.0
    )


async def measure(
    url: str,
    http: str,
    hello: bytes,
    scripts: Sequence[Script],
    clients: int,
    warmup_s: float,
    seconds: float,
) -> dict[str, Any]:
    """M clients over the scripts for warmup + seconds; the window's figures."""
    now = time.monotonic()
    tally = Tally(start=now + warmup_s, end=now + warmup_s + seconds, tokens=[0] * clients)
    offsets = [c * len(scripts) // clients for c in range(clients)]
    loops = [
        asyncio.create_task(client_loop(url, hello, scripts, c, offsets[c], tally)) for c in range(clients)
    ]
    await asyncio.sleep(max(0.0, tally.start - time.monotonic()))
    s0, f0 = await asyncio.to_thread(scrape, http)
    await asyncio.sleep(max(0.0, tally.end - time.monotonic()))
    s1, f1 = await asyncio.to_thread(scrape, http)
    results = await asyncio.gather(*loops, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise RuntimeError(f"{len(failures)} replay clients failed: {failures[0]!r}")
    total = sum(tally.tokens)
    busy, forwards = s1 - s0, f1 - f0
    per_client = [seconds * 1e3 / t for t in tally.tokens if t > 0]
    return {
        "clients": clients,
        "tokens": total,
        "verifier_s": round(busy, 3),
        "forwards": int(forwards),
        "verifier_s_per_token": round(busy / total, 5) if total else None,
        "tokens_per_forward": round(total / forwards, 3) if forwards else None,
        "forwards_per_s": round(forwards / seconds, 3),
        "verifier_busy": round(busy / seconds, 3),
        "client_ms_per_token": median(per_client, 1),
        # the median verify ms of a round (the server's verdict.verify_ms, prompts' rounds left out):
        # with one edge client, the recorded rounds with no drafting beside the verifier
        "V_ms": median(tally.verify_ms, 1),
        "generations": tally.generations,
        "diverged": tally.diverged,
        "errors": len(tally.errors),
        "first_error": tally.errors[0] if tally.errors else None,
    }
