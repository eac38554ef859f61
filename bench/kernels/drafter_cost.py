"""`python -m bench.kernels.drafter_cost`: the drafter's cost per evaluation against its rows, on one thread,
with the verifier idle and with it busy on the other core.

What the outcome cache plans against: on a GPU a batch of rows costs about one row, on
a CPU it does not, and on one machine the verifier's forwards beside the drafter take memory
bandwidth and cache from it. For each backend (llama.cpp on the GGUF, the ONNX int8 export) and
each row count n: the median ms of one evaluation of n rows (n children of the committed end, the
shape of one level of a lockstep draft), first with nothing else running (the verifier not
started), then with the verifier (`cloud-verifier serve`, pinned to the other core) kept busy by a
cloud-only `ar` generation streaming back to back (a one-row forward after another, as a verifier
serving other clients would be). The drafter stays pinned to its own core in both.

Writes a table, JSON rows ({backend, rows, idle_ms, busy_ms, busy_over_idle}), one cost-curve file
per backend and condition beside --json (`<stem>_<backend>_<idle|busy>.json`, {"rows", "ms"}: what
bench.simulation.simulate takes as --drafter-curve) and a plot.

    python -m bench.kernels.drafter_cost --json bench/out/drafter_cost.json --plot bench/out/drafter_cost.png
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.harness import (
    CoreSplit,
    Verifier,
    add_common_args,
    load_prompts,
    positive_ints,
    read_metrics,
    save_figure,
    table,
    write_json,
)
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from edge_client.drafters.base import Drafter
from shared.messages import Error, Hello, Mode, Prompt, Verdict, decode, encode
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
from shared.vocab import vocab_fingerprint

# --backends name -> (registry name, options)
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_cpp": ("llama_cpp", {}),
    "onnx_int8": ("onnx", {"int8": True}),
    "onnx_fp32": ("onnx", {"int8": False}),
    "torch": ("torch", {}),
}
DEFAULT_BACKENDS = ("llama_cpp", "onnx_int8")


def evaluation_ms(d: Any, prompt: list[int], rows: int, repeats: int) -> float:
    """Median ms of one evaluation of `rows` children of the committed end, over `repeats`."""
    times = []
    for r in range(repeats):
        root = d.sync(prompt[: len(prompt) - (r % 2)])  # alternate: no evaluation replays a cache
        top = [int(t) for t in np.argsort(-np.asarray(root))[:rows]]
        t0 = time.perf_counter()
        d.extend([-1] * rows, top)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def curve(
    d: Any, prompt: list[int], rows: Sequence[int], repeats: int, label: str, progress: bool
) -> list[float]:
    out = []
    for n in tqdm(rows, desc=label, disable=not progress, file=sys.stderr):
        out.append(round(evaluation_ms(d, prompt, n, repeats), 2))
    return out


class BusyVerifier:
    """Keeps a verifier busy with cloud-only ar generations, back to back, from a thread."""

    def __init__(self, url: str, fingerprint: str, prompt: list[int], tokens: int) -> None:
        self.url, self.fingerprint, self.prompt, self.tokens = url, fingerprint, prompt, tokens
        self.stop = threading.Event()
        self.generated = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="busy-verifier", daemon=True)

    def __enter__(self) -> BusyVerifier:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)

    def _run(self) -> None:
        try:
            asyncio.run(self._loop())
        except BaseException as exc:  # reported by the caller, which checks the verifier was busy
            self.error = exc

    async def _loop(self) -> None:
        from edge_client.transports import WebSocketTransport

        ws = await WebSocketTransport.connect(self.url)
        try:
            await ws.send(encode(Hello(self.fingerprint)))
            welcome = decode(await ws.recv())
            if isinstance(welcome, Error):
                raise RuntimeError(f"the verifier refused the load client: {welcome.message}")
            prompt = Prompt(np.asarray(self.prompt, dtype=np.int32), mode=Mode.AR, max_new_tokens=self.tokens)
            while not self.stop.is_set():
                await ws.send(encode(prompt))
                while True:
                    msg = decode(await ws.recv())
                    if isinstance(msg, Error):
                        raise RuntimeError(f"the load generation failed: {msg.message}")
                    if isinstance(msg, Verdict):
                        self.generated += len(msg.tokens)
                        if msg.done:
                            break
        finally:
            await ws.close()


def row_counts(text: str) -> list[int]:
    """--rows: a comma list of positive integers, each once, ascending."""
    return sorted(set(positive_ints(text)))


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(
        p, model=DEFAULT_TARGET, model_help="the verifier's target (the busy phase)", draft=DEFAULT_DRAFT
    )
    p.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help="comma list of draft backends: llama_cpp, onnx_int8 (the int8 export, made on first use), "
        "onnx_fp32, torch",
    )
    p.add_argument("--rows", type=row_counts, default=[1, 2, 4, 6, 8, 12, 16], help="row counts to time")
    p.add_argument("--repeats", type=int, default=9, help="evaluations timed per row count (median)")
    p.add_argument("--no-busy", action="store_true", help="skip the busy phase (no verifier is started)")
    add_common_args(p, json=True, json_help="the rows (and curve files beside it)", no_progress=True)
    p.add_argument("--plot", type=Path, default=None, help="draw ms per evaluation against rows to this PNG")


def plot(path: Path, rows: Sequence[dict[str, Any]], backends: Sequence[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for b, color in zip(backends, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        rs = [r for r in rows if r["backend"] == b]
        xs = [r["rows"] for r in rs]
        ax.plot(xs, [r["idle_ms"] for r in rs], "o-", color=color, label=f"{b}, verifier idle")
        if any(r["busy_ms"] is not None for r in rs):
            ax.plot(xs, [r["busy_ms"] for r in rs], "s--", color=color, label=f"{b}, verifier busy")
    ax.set_xlabel("rows per evaluation")
    ax.set_ylabel("ms per evaluation (one thread)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path, dpi=110)


def busy_curves(
    drafters: dict[str, Drafter],
    prompt: list[int],
    counts: Sequence[int],
    repeats: int,
    progress: bool,
    model: str,
    split: CoreSplit,
    fingerprint: str,
) -> tuple[dict[str, list[float]], float]:
    """Each backend's curve with the verifier busy (`model` served on `split.verifier`, kept busy
    by a back-to-back ar load), and the verifier's forwards a second while the drafters were
    timed."""
    busy: dict[str, list[float]] = {}
    with Verifier(model, cores=split.verifier, threads=len(split.verifier), echo=True) as v:
        with BusyVerifier(v.url, fingerprint, prompt[:64], 1024) as load:
            time.sleep(5.0)  # the load's prefill, then steady one-row forwards
            f0, t0 = (
                read_metrics(v.http).get("specdec_verify_forward_seconds_count", 0.0),
                time.monotonic(),
            )
            for b, d in drafters.items():
                busy[b] = curve(d, prompt, counts, repeats, f"{b} busy", progress)
            f1, t1 = (
                read_metrics(v.http).get("specdec_verify_forward_seconds_count", 0.0),
                time.monotonic(),
            )
            if load.error is not None:
                raise RuntimeError(f"the busy verifier's load failed: {load.error}")
            busy_rate = (f1 - f0) / (t1 - t0)
    return busy, busy_rate


def result_rows(
    backends: Sequence[str], counts: Sequence[int], idle: dict[str, list[float]], busy: dict[str, list[float]]
) -> list[dict[str, Any]]:
    """The JSON rows: per backend and row count, the idle and busy ms, their ratio, idle ms a row."""
    rows: list[dict[str, Any]] = []
    for b in backends:
        for i, n in enumerate(counts):
            bm = busy[b][i] if b in busy else None
            rows.append(
                {
                    "backend": b,
                    "rows": n,
                    "idle_ms": idle[b][i],
                    "busy_ms": bm,
                    "busy_over_idle": round(bm / idle[b][i], 3)
                    if bm is not None and idle[b][i] > 0
                    else None,
                    "idle_ms_per_row": round(idle[b][i] / n, 2),
                }
            )
    return rows


def render_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as the printed table (a missing busy figure: "-")."""
    return table(
        [
            [
                r["backend"],
                r["rows"],
                r["idle_ms"],
                r["busy_ms"] or "-",
                r["busy_over_idle"] or "-",
                r["idle_ms_per_row"],
            ]
            for r in rows
        ],
        ["backend", "rows", "idle ms", "busy ms", "busy/idle", "idle ms/row"],
    )


def run(a: argparse.Namespace) -> Result:
    from edge_client.drafters.registry import create_drafter

    backends = [b for b in a.backends.split(",") if b]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise UsageError(f"--backends: unknown {unknown or 'none given'}; choose from {', '.join(BACKENDS)}")
    if a.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    split.pin_edge()
    drafters = {
        b: create_drafter(
            BACKENDS[b][0], a.draft, n_threads=1, max_context=2048, max_nodes=64, **BACKENDS[b][1]
        )
        for b in backends
    }
    try:
        first = next(iter(drafters.values()))
        text = load_prompts(1)[0].text
        prompt = first.tokenizer.encode(text)[:400]
        for d in drafters.values():  # warm up: first-call allocations, weight packing
            evaluation_ms(d, prompt, max(a.rows), 2)
        idle = {
            b: curve(d, prompt, a.rows, a.repeats, f"{b} idle", not a.no_progress)
            for b, d in drafters.items()
        }
        busy: dict[str, list[float]] = {}
        busy_rate: float | None = None
        if not a.no_busy:
            fingerprint = vocab_fingerprint(first.tokenizer.token_texts())
            busy, busy_rate = busy_curves(
                drafters, prompt, a.rows, a.repeats, not a.no_progress, a.model, split, fingerprint
            )
            print(f"verifier busy: {busy_rate:.2f} forwards/s while the drafters were timed", flush=True)
    finally:
        for d in drafters.values():
            d.close()
    rows = result_rows(backends, a.rows, idle, busy)
    if a.json is not None:
        for b in backends:
            for cond, ms in (("idle", idle.get(b)), ("busy", busy.get(b))):
                if (
                    ms is not None
                ):  # bench.simulation.simulate's --drafter-curve: its own format, not a result
                    write_json(
                        a.json.with_name(f"{a.json.stem}_{b}_{cond}.json"), {"rows": list(a.rows), "ms": ms}
                    )
        print(f"wrote the curve files beside {a.json}", flush=True)
    return Result(
        rows,
        render_table(rows),
        extra={"verifier_forwards_per_s": busy_rate},
        plot=lambda path: plot(path, rows, backends),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
