"""Count the project files whose code runs during one round (greedy, static tree): a tracer over a
real edge and verifier.

One process serves the target (cloud_verifier.server.ThreadedServer) and runs an EdgeClient with a
real drafter (greedy, a static tree, no pre-speculation). A profile hook on every thread records
the source file of each Python function called, but only between two verdicts: from the verdict
of round `--round - 1` to the verdict of round `--round`. In between the edge takes up the first
verdict, drafts the next tree and sends it; the verifier decodes it, the engine packs, runs and
verifies it and sends the verdict; the edge reads it. Set-up, the prompt's prefill and imports are
outside the window.

The count and the list, a line per file, are docs/architecture.md's "Files of one round";
tests/bench/test_round_files.py checks that list against this tracer.

    python -m bench round_files                  # SmolLM2-135M target, its q4 GGUF drafting
    python -m bench round_files --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from bench.harness import add_common_args, table
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from shared.messages import Verdict

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("edge_client", "cloud_verifier", "shared", "treespec_kernels")
PROMPT = "def fibonacci(n):"


@dataclass
class Recorder:
    """The product files whose functions were called while `on` (a profile hook, every thread)."""

    on: bool = False
    files: set[str] = field(default_factory=set)

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if self.on and event == "call":
            self.files.add(frame.f_code.co_filename)

    def product_files(self) -> list[str]:
        out = set()
        for name in self.files:
            path = Path(name)
            if path.is_absolute() and path.is_relative_to(ROOT):
                rel = path.relative_to(ROOT)
                if rel.parts and rel.parts[0] in PRODUCT:
                    out.add(rel.as_posix())
        return sorted(out)


async def _one_generation(url: str, drafter_backend: str, draft: str, round_no: int, rec: Recorder) -> int:
    """Generate until round `round_no`'s verdict, tracing from the verdict before it; the rounds seen."""
    from edge_client.client import EdgeClient, TreeSpec
    from edge_client.drafters.registry import create_drafter

    kw = {"n_threads": 1} if drafter_backend == "llama_cpp" else {}
    drafter = create_drafter(drafter_backend, draft, **kw)
    seen: list[int] = []

    def on_verdict(v: Verdict, prespeculated: bool) -> None:
        r = v.round
        seen.append(r)
        if r == round_no - 1:
            rec.on = True
        elif r == round_no:
            rec.on = False

    async with EdgeClient(url, drafter, tree=TreeSpec(), prespec=False) as client:
        async for _ in client.generate(PROMPT, max_new_tokens=64, on_verdict=on_verdict):
            pass
    return len(seen)


def trace_round(target: str, drafter_backend: str, draft: str, round_no: int) -> list[str]:
    """The product files that ran during round `round_no` (module doc)."""
    from cloud_verifier.server import ThreadedServer
    from cloud_verifier.server_config import ServerConfig
    from shared.model import load_target

    loaded = load_target(target, progress=False)
    rec = Recorder()
    threading.setprofile(rec.hook)  # threads started from now on: the server, the engine, drafting
    sys.setprofile(rec.hook)
    try:
        with ThreadedServer(ServerConfig(max_context=4096), target=loaded) as srv:
            rounds = asyncio.run(_one_generation(srv.url, drafter_backend, draft, round_no, rec))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    if rounds <= round_no:
        raise RuntimeError(f"the generation ended after {rounds} rounds, before round {round_no}")
    return rec.product_files()


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", default="smollm2-135m", help="target model alias of the verifier")
    ap.add_argument("--drafter", default="llama_cpp", help="drafter backend of the edge")
    add_model_args(ap, draft="smollm2-135m-q4", draft_help="draft model alias")
    ap.add_argument("--round", type=int, default=2, help="the round traced (>= 1: round 0 is the prompt's)")
    add_common_args(ap, json=True)


def run(args: argparse.Namespace) -> Result:
    if args.round < 1:
        raise UsageError("--round must be at least 1 (round 0 answers the prompt)")
    files = trace_round(args.target, args.drafter, args.draft, args.round)
    shown = table([(f,) for f in files], ["file"])
    shown += f"\n{len(files)} project files ran during round {args.round}"
    return Result([{"file": f} for f in files], shown, extra={"count": len(files)})


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
