"""What the edge's drafting costs the verifier when both share one machine (as in `make demo`).

    python -m bench colocation --pairs 6 --tokens 48 --json out.json

Starts the verifier on its own cores (bench.harness.CoreSplit, as the demo does), pins this
process to the edge's, and runs `ar` generations back to back, alternating an idle edge with one
whose drafter evaluates `--rows`-row tree levels in a loop on its core (no tree is sent: the
verifier's work is the same `ar` decoding either way). Per generation: the user's ms per token
(the median gap between streamed tokens) and the verifier's own ms per step (the median of the
verdicts' verify_ms), and, over the pairs, the medians of both phases and their ratio. A ratio
above 1 is time the verifier loses to the edge beside it: speculation on one machine pays it on
every forward, a deployment with the edge on its own device does not.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from bench.harness import CoreSplit, Verifier, add_common_args, table
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from edge_client.client import EdgeClient
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from shared.model.target import resolve_weights

PROMPT = "def quicksort(items):\n"


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(ap, model="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-q4", help="draft alias run beside the verifier")
    ap.add_argument("--pairs", type=int, default=6, help="idle / drafting generation pairs (alternated)")
    ap.add_argument("--rows", type=int, default=4, help="rows per drafter evaluation in the drafting phase")
    add_common_args(ap, json=True, json_help="rows: one per generation; the phases' medians beside them",
                    tokens=48, no_progress=True)  # fmt: skip


def _draft_loop(drafter: Drafter, rows: int, stop: threading.Event) -> None:
    """Tree levels of `rows` nodes below a fixed context, restarted when the workspace fills."""
    context = list(range(1000, 1100))
    drafter.sync(context)
    while not stop.is_set():
        if drafter.num_nodes + rows > 48:
            drafter.sync(context)
        parent = -1 if drafter.num_nodes == 0 else drafter.num_nodes - 1
        drafter.extend([parent] * rows, [1234 + i for i in range(rows)])


async def _generate(url: str, drafter: Drafter, tokens: int) -> tuple[float, float]:
    """(the user's ms per token, the verifier's ms per step) of one `ar` generation."""
    gaps: list[float] = []
    async with EdgeClient(url, drafter) as c:
        last = None
        async for _ in c.generate(PROMPT, max_new_tokens=tokens, mode="ar"):
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1e3)
            last = now
        assert c.last is not None
        steps = c.last.stats.verify_ms[1:]  # the first is the prompt's prefill
    if not gaps or not steps:
        raise UsageError("a generation ended before its second token; raise --tokens")
    return statistics.median(gaps), statistics.median(steps)


def run(a: argparse.Namespace) -> Result:
    if a.pairs < 1 or a.rows < 1 or a.tokens < 4:
        raise UsageError("--pairs and --rows must be at least 1 and --tokens at least 4")
    split = CoreSplit.auto()
    weights = ["--weights", resolve_weights(a.model)]
    rows: list[dict[str, Any]] = []
    with Verifier(a.model, cores=split.verifier, threads=len(split.verifier), args=weights) as v:
        split.pin_edge()
        busy, client = (create_drafter("auto", a.draft, n_threads=1) for _ in range(2))
        try:
            for i in tqdm(range(2 * a.pairs), desc="generations", file=sys.stderr, disable=a.no_progress):
                phase = "drafting" if i % 2 else "idle"
                stop = threading.Event()
                loop = threading.Thread(target=_draft_loop, args=(busy, a.rows, stop), daemon=True)
                if phase == "drafting":
                    loop.start()
                    time.sleep(0.5)
                try:
                    user, step = asyncio.run(_generate(v.url, client, a.tokens))
                finally:
                    stop.set()
                    if loop.is_alive():
                        loop.join()
                rows.append({"pair": i // 2, "phase": phase, "user_ms_per_token": round(user, 2),
                             "verifier_step_ms": round(step, 2)})  # fmt: skip
        finally:
            busy.close()
            client.close()
    med = {p: {k: statistics.median(float(r[k]) for r in rows if r["phase"] == p)
               for k in ("user_ms_per_token", "verifier_step_ms")} for p in ("idle", "drafting")}  # fmt: skip
    summary = {
        "model": a.model,
        "draft": a.draft,
        "draft_rows": a.rows,
        "cores": {"edge": list(split.edge), "verifier": list(split.verifier)},
        "median": med,
        "step_ratio": round(med["drafting"]["verifier_step_ms"] / med["idle"]["verifier_step_ms"], 3),
        "user_ratio": round(med["drafting"]["user_ms_per_token"] / med["idle"]["user_ms_per_token"], 3),
    }
    text = table(
        [[p, f"{m['user_ms_per_token']:.1f}", f"{m['verifier_step_ms']:.1f}"] for p, m in med.items()],
        ["edge", "user ms/token", "verifier ms/step"],
    )
    text += f"\nedge drafting: verifier steps x{summary['step_ratio']}, user x{summary['user_ratio']}"
    return Result(rows, text, extra=summary)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
