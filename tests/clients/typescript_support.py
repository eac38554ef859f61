"""What the TypeScript client's tests share: the package built once (skipped, saying why, without
Node 20 and npm), its CLI, the repeating prompt and its seeded target-only tokens, and the tiny
model exported to ONNX."""

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
from tests.cloud_verifier.service import AsyncSession, tiny

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


# a prompt that repeats itself, where prompt lookup finds continuations
PROMPT = [101, 102, 103, 104, 105, 106, 101, 102, 103, 104, 105, 106, 101, 102]


def _seeded_ar(url: str) -> list[int]:
    """Target-only decoding of PROMPT in mode ar at T 0.9, seed 77, 30 tokens."""

    async def ar() -> list[int]:
        s = await AsyncSession.open(url)
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

    return asyncio.run(ar())


def _auto_cli(url: str, *args: str) -> dict[str, object]:
    return _cli("--server", url, "--fingerprint", tiny().vocab_fingerprint,
                "--prompt-ids", ",".join(map(str, PROMPT)), *args)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model exported to ONNX (fp32), as `edge-client export-onnx tiny` writes it."""
    from edge_client.onnx.export import export

    out = tmp_path_factory.mktemp("onnx") / "tiny"
    export("tiny", out, progress=False)
    return out
