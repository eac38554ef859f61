"""The TypeScript client (clients/typescript): its own tests (the protocol vectors, prompt lookup)
and, against a live verifier, exactly the tokens of target-only decoding. Skipped, saying why, on a
machine without Node 20 and npm."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from shared.messages import Mode, Prompt, Verdict, Welcome
from tests.cloud_verifier.service import AsyncSession, LiveServer, reference, tiny

TS = Path(__file__).resolve().parents[2] / "clients" / "typescript"


@functools.cache
def _built() -> str | None:
    """Install and compile once; None when it worked, else why not."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return "Node.js 20 and npm are not installed: the TypeScript client's tests are skipped"
    major = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip().lstrip("v")
    if int(major.split(".")[0]) < 20:
        return f"Node.js {major} is older than 20: the TypeScript client's tests are skipped"
    if not (TS / "node_modules").exists():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=TS, check=True, capture_output=True)
    subprocess.run([npm, "run", "build"], cwd=TS, check=True, capture_output=True)
    return None


@pytest.fixture
def built() -> None:
    why = _built()
    if why is not None:
        pytest.skip(why)


def _cli(*args: str) -> dict[str, object]:
    r = subprocess.run(
        ["node", "dist/src/cli.js", *args, "--json"], cwd=TS, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    doc: dict[str, object] = json.loads(r.stdout)
    return doc


def test_typescript_unit_tests_and_vectors(built: None) -> None:
    r = subprocess.run(["node", "--test", "dist/test/"], cwd=TS, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "# fail 0" in r.stdout and "# pass " in r.stdout


# a prompt that repeats itself, where prompt lookup finds continuations
PROMPT = [101, 102, 103, 104, 105, 106, 101, 102, 103, 104, 105, 106, 101, 102]


def test_greedy_through_the_typescript_client_equals_target_only(built: None) -> None:
    with LiveServer() as srv:
        out = _cli("--server", srv.ws, "--fingerprint", tiny().vocab_fingerprint,
                   "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "40")  # fmt: skip
    assert out["tokens"] == reference(tuple(PROMPT), 40)
    stats = out["stats"]
    assert isinstance(stats, dict) and stats["tokens"] == len(out["tokens"])


def test_seeded_match_through_the_typescript_client_equals_seeded_ar(built: None) -> None:
    with LiveServer() as srv:

        async def ar() -> list[int]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(np.array(PROMPT), Mode.AR, 0.9, 0, 1.0, 77, 30)))
            toks: list[int] = []
            while True:
                v = await s.recv()
                assert isinstance(v, Verdict)
                toks += v.tokens.tolist()
                if v.done:
                    await s.close()
                    return toks

        want = asyncio.run(ar())
        out = _cli("--server", srv.ws, "--fingerprint", tiny().vocab_fingerprint, "--prompt-ids",
                   ",".join(map(str, PROMPT)), "--mode", "match", "--temperature", "0.9", "--seed", "77",
                   "--max-new-tokens", "30")  # fmt: skip
    assert out["tokens"] == want
