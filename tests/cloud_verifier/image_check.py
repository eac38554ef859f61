"""Smoke test of a running verifier container, from the host (`make image-test`).

Waits for /readyz, generates greedily through the edge client (llama.cpp SmolLM2 draft) and with
target-only `ar` decoding on the same server, and checks the two token lists are equal; optionally
runs a command that prints the container's user id and checks it is not root.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from edge_client.drafters.base import Drafter

PROMPT = "Write a haiku about rain."


async def _generate(url: str, drafter: Drafter, mode: str, tokens: int) -> list[int]:
    from edge_client.client import EdgeClient

    async with EdgeClient(url, drafter, prespec=mode != "ar") as c:
        async for _ in c.generate(PROMPT, max_new_tokens=tokens, mode=mode):
            pass
        assert c.last is not None
        return list(c.last.tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cloud_verifier.image_check", description=__doc__)
    ap.add_argument("--url", required=True, help="ws:// URL of the verifier's session endpoint")
    ap.add_argument("--draft", default="smollm2-135m-q4", help="draft alias (llama.cpp)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for /readyz")
    ap.add_argument("--user-check", default=None, help="a command printing the container's uid")
    a = ap.parse_args(argv)
    http = a.url.replace("ws://", "http://").replace("wss://", "https://").split("/v1/")[0]
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(http + "/readyz", timeout=3).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > a.timeout:
            print(f"image-check: {http}/readyz not 200 within {a.timeout:g} s", file=sys.stderr)
            return 1
        time.sleep(1)
    print(f"image-check: ready after {time.monotonic() - t0:.0f} s", flush=True)
    from edge_client.drafters.registry import create_drafter

    drafter = create_drafter("llama_cpp", a.draft, n_threads=1)
    try:
        spec = asyncio.run(_generate(a.url, drafter, "greedy", a.tokens))
        ar = asyncio.run(_generate(a.url, drafter, "ar", a.tokens))
    finally:
        drafter.close()
    ok = spec == ar and len(ar) > 0
    print(f"image-check: greedy through the edge client == target-only ar ({len(ar)} tokens): {ok}")
    if a.user_check:
        uid = subprocess.run(shlex.split(a.user_check), capture_output=True, text=True).stdout.strip()
        print(f"image-check: container user id {uid or '?'} (must not be 0)")
        ok &= uid.isdigit() and uid != "0"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
