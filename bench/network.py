"""Latency over a network: target-only AR vs sequence vs tree vs tree + pre-speculation (DESIGN 6).

For every round-trip time, every mode runs the same Spec-Bench prompts, greedy and at temperature
0.7 (sample-and-match). The link is emulated either in the client's process (a delay and
bandwidth shaper in its transport) or, with --proxy, by a TCP delay proxy run as a separate
process between the client and the verifier (real sockets; `tc netem` is not available on these
machines). Verifier and edge are pinned to disjoint cores.

    python -m bench.network --proxy --rtt-ms 0,25,50,100 --prompts 20 --tokens 128 \\
        --json bench/out/network.json --plot bench/out/network.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.e2e import run_modes, trusted_key_file
from bench.harness import CoreSplit, Verifier, die_with_parent, free_port, load_suite, table
from edge_client.defaults import recommended_tree
from edge_client.drafters.registry import create_drafter
from edge_client.transport import LinkShape
from shared.messages import Mode
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
from shared.tree import ExpansionConfig

MODES = ("ar", "sequence", "tree", "tree_prespec")
OPTIONAL = (
    "tree_prespec_ungated",
    "tree_prespec_frugal",
    "tree_prespec_single",
    "sequence_prespec",
    "sequence_prespec_single",
    "budget",
    "budget_prespec",
    "tree_rrs",
    "tree_prespec_rrs",
)
# run settings that must agree for rows of several files to form one table (--merge)
SAME_RUN = (
    "draft",
    "model",
    "humaneval",
    "prompts",
    "tokens",
    "tree",
    "proxy",
    "jitter_ms",
    "bandwidth_mbps",
    "no_couple",
)
ROW_KEYS = (
    *("rtt_ms", "mode", "temperature", "ms_per_token", "tau", "hit_rate", "target_forwards_per_token"),
    *("bytes_up_per_token", "bytes_down_per_token", "draft_ms_per_round", "verify_ms_per_round"),
    "rtt_ms_per_round",
)


class Proxy:
    """`python -m bench.netproxy` in its own process, on the edge's cores."""

    def __init__(
        self, target_port: int, rtt_ms: float, jitter_ms: float, mbps: float, cores: Sequence[int]
    ) -> None:
        self.port = free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "bench.netproxy",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--target",
            f"127.0.0.1:{target_port}",
            "--delay-ms",
            str(rtt_ms / 2),
            "--jitter-ms",
            str(jitter_ms),
            "--bandwidth-mbps",
            str(mbps),
        ]
        self.cores = set(cores)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Proxy:
        import os
        import socket

        cores = self.cores

        def pin() -> None:
            if cores and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)
            die_with_parent()

        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the delay proxy did not start") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/session"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.2), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted(
                (r["rtt_ms"], r["ms_per_token"]) for r in rows if r["temperature"] == t and r["mode"] == mode
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_title(f"{'greedy' if t == 0 else f'match, T={t}'}")
        ax.set_xlabel("round-trip time (ms)")
        ax.set_ylabel("ms per token (median)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.network",
        description="ms/token against round-trip time for ar, sequence, tree and tree + pre-speculation.",
    )
    ap.add_argument("--rtt-ms", default="0,25,50,100", help="comma-separated round-trip times to emulate")
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (the code prompt, raw)")
    ap.add_argument(
        "--prompts", type=int, default=4, help="Spec-Bench dev prompts (round-robin over categories)"
    )
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument(
        "--draft", default=DEFAULT_DRAFT, help="draft alias or GGUF path (or an ONNX export folder)"
    )
    ap.add_argument(
        "--drafter",
        default="llama_cpp",
        choices=["llama_cpp", "torch", "onnx"],
        help="draft backend (onnx: --draft may also be an `edge-client export-onnx` folder)",
    )
    ap.add_argument("--model", default=DEFAULT_TARGET, help="target model of the verifier")
    ap.add_argument(
        "--tree",
        default=None,
        help="expansion config of the tree modes (the sequence draft is as deep); default: the draft's "
        "recommended tree (edge_client.defaults: measured per pair, README)",
    )
    ap.add_argument("--temperatures", default="0,0.7", help="0 = greedy; others run sample-and-match")
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"modes to run, from {','.join(MODES + OPTIONAL)}"
    )
    ap.add_argument(
        "--proxy",
        action="store_true",
        help="put a TCP delay proxy process on the path instead of the in-process link shaper",
    )
    ap.add_argument(
        "--jitter-ms", type=float, default=0.0, help="jitter of the emulated link (never reorders)"
    )
    ap.add_argument("--bandwidth-mbps", type=float, default=0.0, help="bandwidth cap of the link (0: none)")
    ap.add_argument(
        "--max-pending", type=int, default=8, help="the verifier's max_pending (conditional trees)"
    )
    ap.add_argument("--json", default=None, help="write {'rows': [...]} to this file")
    ap.add_argument("--plot", default=None, help="draw ms/token against RTT to this PNG")
    ap.add_argument(
        "--no-couple",
        action="store_true",
        help="sample-and-match rows draft without the verifier's keyed uniforms (the draft's most likely "
        "tokens lead each node instead of the token the target is likely to sample)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument(
        "--merge",
        default=None,
        metavar="A.json,B.json",
        help="run nothing: merge the rows of earlier --json files (a later file's row replaces an "
        "earlier one for the same RTT, mode and temperature), then print the table and goals and "
        "write --json / --plot; the files must share draft, model, prompts, tokens and tree",
    )
    a = ap.parse_args(argv)
    if a.merge:
        try:
            merged, config = merge([p for p in a.merge.split(",") if p])
        except ValueError as exc:
            ap.error(f"--merge: {exc}")
        return report(a, merged, config)
    try:
        rtts = [float(x) for x in a.rtt_ms.split(",") if x]
        temps = [float(x) for x in a.temperatures.split(",") if x]
    except ValueError as exc:
        ap.error(f"--rtt-ms and --temperatures take comma-separated numbers ({exc})")
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES + OPTIONAL]
    if unknown or not modes:
        ap.error(f"--modes: unknown {unknown or 'none given'}; choose from {','.join(MODES + OPTIONAL)}")
    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    print(f"link: {'TCP delay proxy process' if a.proxy else 'in-process shaper'}", flush=True)
    prompts = load_suite(a.humaneval, a.prompts)
    a.tree = a.tree or recommended_tree(a.draft)
    tree = ExpansionConfig.parse(a.tree)
    rows: list[dict[str, Any]] = []
    args = ["--max-pending", str(a.max_pending)]
    api_key = None
    if any(m.endswith("_rrs") for m in modes):
        key_file, api_key = trusted_key_file()
        args += ["--api-key-file", str(key_file)]
    verifier = Verifier(a.model, cores=split.verifier, threads=len(split.verifier), args=args)
    with verifier:
        split.pin_edge()
        drafter = create_drafter(a.drafter, a.draft, n_threads=1)
        try:
            for rtt in rtts:
                for temp in temps:
                    mode = Mode.GREEDY if temp == 0 else Mode.MATCH
                    run = [m for m in modes if temp > 0 or not m.endswith("_rrs")]  # rrs samples
                    if not run:
                        continue
                    with contextlib.ExitStack() as stack:
                        url, link = verifier.url, None
                        if a.proxy:
                            proxy = Proxy(verifier.port, rtt, a.jitter_ms, a.bandwidth_mbps, split.edge)
                            url = stack.enter_context(proxy).url
                        else:
                            link = LinkShape.rtt(rtt, a.jitter_ms, a.bandwidth_mbps)
                        runs, _ = asyncio.run(
                            run_modes(
                                url,
                                drafter,
                                prompts,
                                a.tokens,
                                temp,
                                mode,
                                tree,
                                verifier.forwards,
                                modes=run,
                                progress=not a.no_progress,
                                link=link,
                                api_key=api_key,
                                couple=not a.no_couple,
                            )
                        )
                    for m, r in runs.items():
                        s = r.summary()
                        rows.append(
                            {
                                "rtt_ms": rtt,
                                "mode": m,
                                "temperature": temp,
                                "ms_per_token": s["ms_per_token"],
                                "tau": s["tau"],
                                "hit_rate": s["hit_rate"] if "prespec" in m else None,
                                "hit_rate_by_depth": s["hit_rate_by_depth"] if "prespec" in m else None,
                                "predicted_hit_rate": s["predicted_hit_rate"] if "prespec" in m else None,
                                "target_forwards_per_token": s["target_forwards_per_token"],
                                "bytes_up_per_token": s["bytes_up_per_token"],
                                "bytes_down_per_token": s["bytes_down_per_token"],
                                "draft_ms_per_round": s["draft_ms_per_round"],
                                "verify_ms_per_round": s["verify_ms_per_round"],
                                "rtt_ms_per_round": s["rtt_ms_per_round"],
                                "prespec_draft_ms_per_round": s["prespec_draft_ms_per_round"],
                                "prespec_trees_per_round": s["prespec_trees_per_round"],
                                "prespec_cancelled_per_round": s["prespec_cancelled_per_round"],
                                "prespec_refused_per_round": s["prespec_refused_per_round"],
                            }
                        )
                    print(f"rtt {rtt:g} ms, T={temp:g}: done", flush=True)
                    _write(a.json, rows, vars(a), complete=False)  # a crash later keeps what is measured
        finally:
            drafter.close()
    return report(a, rows, vars(a))


def merge(paths: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of several `--json` files of one setup (the last file wins for a repeated (RTT, mode,
    T)), and the first file's config with `merged_from` added."""
    if not paths:
        raise ValueError("name at least one JSON file")
    merged: dict[tuple[float, str, float], dict[str, Any]] = {}
    first: dict[str, Any] | None = None
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a bench.network JSON file ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            raise ValueError(f"{path}: no 'rows' list; is it a bench.network --json file?")
        cfg = doc.get("config") or {}
        if first is None:
            first = cfg
        diff = [k for k in SAME_RUN if cfg.get(k) != first.get(k)]
        if diff:
            raise ValueError(
                f"{path} was run with other settings than {paths[0]}: "
                + ", ".join(f"{k} {cfg.get(k)!r} vs {first.get(k)!r}" for k in diff)
            )
        for i, r in enumerate(doc["rows"]):
            if not isinstance(r, dict) or any(k not in r for k in ROW_KEYS):
                raise ValueError(f"{path}: row {i} lacks one of {', '.join(ROW_KEYS)}")
            merged[(float(r["rtt_ms"]), str(r["mode"]), float(r["temperature"]))] = r
    assert first is not None
    order = {m: i for i, m in enumerate(MODES + OPTIONAL)}
    rows = sorted(merged.values(), key=lambda r: (r["rtt_ms"], r["temperature"], order.get(r["mode"], 99)))
    config = {
        **first,
        "rtt_ms": ",".join(f"{x:g}" for x in sorted({r["rtt_ms"] for r in rows})),
        "temperatures": ",".join(f"{x:g}" for x in sorted({r["temperature"] for r in rows})),
        "modes": ",".join(dict.fromkeys(r["mode"] for r in rows)),
        "merged_from": list(paths),
        "json": None,
        "plot": None,
        "merge": None,
    }
    return rows, config


def report(a: argparse.Namespace, rows: list[dict[str, Any]], config: dict[str, Any]) -> int:
    """The table, the goals, the JSON (complete; with `config`) and the plot."""
    c = config
    merged = f", merged from {len(c['merged_from'])} files" if c.get("merged_from") else ""
    n_he, n_sb = c.get("humaneval", 0), c.get("prompts")
    size = f"{n_he} HumanEval + {n_sb} Spec-Bench prompts x {c.get('tokens')} tokens"
    print(f"\n{c.get('model')} verifier, draft {c.get('draft')}, {size}{merged} (medians)")
    print(
        table(
            [
                [
                    r["rtt_ms"],
                    r["temperature"],
                    r["mode"],
                    r["ms_per_token"],
                    r["tau"],
                    "-" if r["hit_rate"] is None else r["hit_rate"],
                    r["target_forwards_per_token"],
                    r["bytes_up_per_token"],
                    r["bytes_down_per_token"],
                    r["draft_ms_per_round"],
                    r["verify_ms_per_round"],
                    r["rtt_ms_per_round"],
                ]
                for r in rows
            ],
            [
                "rtt",
                "T",
                "mode",
                "ms/token",
                "tau",
                "hit",
                "fwd/token",
                "B up/tok",
                "B down/tok",
                "draft ms/rnd",
                "verify ms/rnd",
                "net ms/rnd",
            ],
        )
    )
    _goals(rows)
    _write(a.json, rows, config, complete=True)
    if a.plot:
        plot(rows, a.plot)
        print(f"plot: {a.plot}")
    return 0


def _write(path: str | None, rows: list[dict[str, Any]], config: dict[str, Any], complete: bool) -> None:
    """The JSON file, rewritten after every RTT x temperature block (`complete` false until the end)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        doc = {"rows": rows, "complete": complete, "config": config}
        Path(path).write_text(json.dumps(doc, indent=2))


def _goals(rows: list[dict[str, Any]]) -> None:
    """Print the issue's goals as measured (benchmark figures, not tests)."""

    def get(rtt: float, mode: str, t: float) -> float | None:
        for r in rows:
            if r["rtt_ms"] == rtt and r["mode"] == mode and r["temperature"] == t:
                return float(r["ms_per_token"])
        return None

    for t in sorted({r["temperature"] for r in rows}):
        tree50, pre50, ar50 = get(50, "tree", t), get(50, "tree_prespec", t), get(50, "ar", t)
        if tree50 and pre50:
            print(f"T={t:g}: at RTT 50 tree_prespec/tree = {pre50 / tree50:.3f}")
        if ar50 and pre50:
            goal = 0.30 if t == 0 else 0.45
            verdict = "met" if pre50 / ar50 <= goal else "not met"
            print(f"T={t:g}: at RTT 50 tree_prespec/ar = {pre50 / ar50:.3f} (goal <= {goal:.2f}: {verdict})")
        slower = [
            r
            for r in sorted({r["rtt_ms"] for r in rows})
            if (get(r, "tree_prespec", t) or 0) > (get(r, "tree", t) or float("inf"))
        ]
        print(f"T={t:g}: RTTs where tree_prespec is slower than tree: {slower or 'none'}")
        t0, t50 = get(0, "tree", t), get(50, "tree", t)
        tau = next(
            (r["tau"] for r in rows if r["rtt_ms"] == 50 and r["mode"] == "tree" and r["temperature"] == t),
            None,
        )
        if t0 and t50 and tau:
            print(
                f"T={t:g}: tree ms/token at RTT 50 - at RTT 0 = {t50 - t0:.1f} "
                f"(expected ~50/tau = {50 / tau:.1f})"
            )


if __name__ == "__main__":
    sys.exit(main())
