"""The cloud's cost per generated token: M edge clients (recorded real-pair generations in --mode,
replayed frame by frame as separate devices would send them) against M cloud-only ar clients, at
saturation; measured on this CPU and predicted for a flat (GPU-shaped) verifier.

`python -m bench load --cloud-cost` runs this bench too. The edge clients run in the default
pre-speculating mode unless --mode names another.

The edge's drafting runs on the user's device, not on the verifier's machine, so the cloud's cost
is the verifier's busy time. On one 2-core machine sixteen real drafters cannot run beside the
verifier, so the bench measures in two phases:

1. **Record** (the real pair, co-located as in bench.end_to_end.network: the drafter on core 0, the verifier
   on core 1, the link emulated at --rtt-ms): each prompt is generated once by a real edge client
   in --mode (default `tree_prespec`), through a transport that logs every frame with its time.
   Each generation becomes a script: every frame the edge sent, with the number of verdicts it had
   taken up before it left and how long after the last of them (at the wire: the round trip and
   the edge's drafting are inside that delay), and the tokens the verifier answered.
2. **Replay** (the verifier alone on core 1; the clients are frame players on core 0, costing next
   to nothing, as separate devices would): M clients connect, each loops over the scripts from
   its own offset, and sends each frame as the edge did: once the same number of verdicts has
   arrived, the same delay after the last. Pre-speculated trees thus reach a loaded verifier even
   earlier than they did alone (the edge's drafting time is the edge's, whatever the load), and a
   tree drafted after a miss leaves the same time after the verdict. Cloud-only `ar` clients send
   the same prompts in mode ar. Every verdict's tokens are checked against the recording (greedy
   or seeded: the replay must reproduce it; a generation that differs is cancelled and counted
   as `diverged`).

Per (kind, M), over --seconds after --warmup: verifier-seconds per generated token (the engine's
forward seconds, from /metrics, over every client's tokens), tokens per forward, forwards per
second and each client's ms/token (median over clients); the ratio edge / ar of verifier-seconds
per token is the table's point (the goal: <= 1/3 with 16 clients on this CPU).

**Flat cost curve (a GPU's shape).** `predict_flat` replays the same scripts in a discrete-event
model of a verifier whose forward costs --flat-ms whatever its rows (every ready session packed
into the next forward): the predicted verifier-seconds per token of both kinds at each M, beside
the measured ones (the goal: <= 1/5).

    python -m bench load_cost --clients 1,4,16 --scripts scripts.json --json out.json --plot out.png
    python -m bench load_cost --flat-only --scripts scripts.json --flat-ms 12
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.harness import (
    BenchPrompt,
    CoreSplit,
    Verifier,
    add_common_args,
    positive_ints,
    save_figure,
    suite_from_args,
    table,
    write_json,
)
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.replay import Script, Step
from bench.lib.runner import Result, UsageError

# the record and replay phases (bench.serving.load_cost_phases), re-exported here
from bench.serving.load_cost_phases import client_loop as client_loop
from bench.serving.load_cost_phases import measure as measure
from bench.serving.load_cost_phases import record as record
from bench.serving.load_cost_phases import scrape as scrape
from edge_client.drafters.registry import backend_choices
from shared.messages import Prompt, Tree, decode
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

KINDS = ("ar", "edge")


# ----------------------------------------------------------------------------------- flat model
@dataclass(frozen=True)
class FlatRound:
    """A round as the verifier serves it: its tree left after `after` verdicts, `delay_s` after the
    last of them (server-side times: the round trip and the edge's drafting are inside), and its
    verdict carried `tokens`."""

    after: int
    delay_s: float
    tokens: int


def flat_rounds(script: Script, ar: bool) -> list[FlatRound]:
    """The rounds of one recorded generation: each verdict matched with the frame that carried the
    round it verified (pre-speculated trees that were never verified cost the verifier nothing).
    Cloud-only ar: a token a forward, each ready as soon as the previous one is out."""
    if ar:
        return [FlatRound(0, 0.0, 1) for _ in script.tokens]
    carried: dict[int, Step] = {}
    for step in script.steps:
        msg = decode(step.frame)
        rnd = 0 if isinstance(msg, Prompt) else msg.round if isinstance(msg, Tree) else None
        if rnd is not None:
            carried.setdefault(rnd, step)
    out = []
    for rnd, n in script.verdicts:
        s = carried.get(rnd, script.steps[0])
        out.append(FlatRound(s.after, s.delay_s, n))
    return out


def predict_flat(
    games: Sequence[Sequence[FlatRound]], clients: int, flat_s: float, seconds: float
) -> dict[str, float]:
    """A verifier whose forward takes `flat_s` whatever it packs: every session whose next tree is
    at the verifier joins the next forward. Each client loops over `games` (one generation's rounds
    each) from its own offset; verifier-seconds per token and tokens per forward over `seconds`."""
    t = 0.0
    # per client: game index, round index, the times of its verdicts in this game (index 0: start)
    games_at = [c * len(games) // clients for c in range(clients)]
    rounds_at = [0] * clients
    arrived: list[list[float]] = [[0.0] for _ in range(clients)]
    ready: list[tuple[float, int]] = [(0.0, c) for c in range(clients)]
    heapq.heapify(ready)
    tokens = forwards = 0
    while ready and t < seconds:
        t = max(t, ready[0][0])
        batch = []
        while ready and ready[0][0] <= t:
            batch.append(heapq.heappop(ready)[1])
        t += flat_s
        forwards += 1
        for c in batch:
            game = games[games_at[c] % len(games)]
            tokens += game[rounds_at[c]].tokens
            arrived[c].append(t)
            rounds_at[c] += 1
            if rounds_at[c] >= len(game):  # the next generation's prompt leaves at once
                games_at[c], rounds_at[c], arrived[c] = games_at[c] + 1, 0, [t]
                heapq.heappush(ready, (t, c))
                continue
            nxt = game[rounds_at[c]]
            seen = arrived[c]
            heapq.heappush(ready, (max(t, seen[min(nxt.after, len(seen) - 1)] + nxt.delay_s), c))
    return {
        "verifier_s_per_token": forwards * flat_s / tokens if tokens else float("nan"),
        "tokens_per_forward": tokens / forwards if forwards else float("nan"),
    }


# ----------------------------------------------------------------------------------- main
def save_scripts(path: Path, hello: bytes, scripts: Sequence[Script], config: dict[str, Any]) -> None:
    doc = {
        "config": config,
        "hello": hello.hex(),
        "scripts": [
            {
                "prompt_index": s.prompt_index,
                "ms_per_token": s.ms_per_token,
                "tokens": s.tokens,
                "verdicts": s.verdicts,
                "steps": [
                    {"frame": st.frame.hex(), "after": st.after, "delay_s": st.delay_s} for st in s.steps
                ],
            }
            for s in scripts
        ],
    }
    write_json(path, doc)  # this bench's own input (--scripts), not a result


def load_scripts(path: Path) -> tuple[bytes, list[Script], dict[str, Any]]:
    """Scripts an earlier run saved (--scripts); every frame is decoded (checked) before use."""
    try:
        doc = json.loads(path.read_text())
        hello = bytes.fromhex(doc["hello"])
        scripts = [
            Script(
                int(s["prompt_index"]),
                [
                    Step(bytes.fromhex(st["frame"]), int(st["after"]), float(st["delay_s"]))
                    for st in s["steps"]
                ],
                [int(x) for x in s["tokens"]],
                [(int(r), int(n)) for r, n in s["verdicts"]],
                float(s["ms_per_token"]),
            )
            for s in doc["scripts"]
        ]
        decode(hello)
        for s in scripts:
            for st in s.steps:
                decode(st.frame)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--scripts {path}: not a script file of this bench ({exc})") from None
    if not scripts:
        raise ValueError(f"--scripts {path}: no scripts in it")
    return hello, scripts, dict(doc.get("config") or {})


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--clients", type=positive_ints, default=[1, 4, 16], help="concurrent clients; a comma list runs each"
    )
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds per (kind, clients) run")
    p.add_argument(
        "--warmup", type=float, default=10.0, help="seconds of each run before the measured window"
    )
    add_model_args(
        p, model=DEFAULT_TARGET, draft=DEFAULT_DRAFT, draft_help="draft alias or GGUF path (the record phase)"
    )
    p.add_argument(
        "--drafter",
        default="auto",
        choices=backend_choices(),
        help="draft backend of the record phase (auto: the faster of llama.cpp and ONNX int8, measured)",
    )
    p.add_argument(
        "--mode", default="tree_prespec", help="the edge clients' mode (a bench.end_to_end.network mode name)"
    )
    p.add_argument("--tree", default=None, help="expansion config of the edge's tree (default: the draft's)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="round trip of the recorded link")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sample-and-match")
    p.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (raw)")
    p.add_argument("--prompts", type=int, default=4, help="Spec-Bench dev prompts")
    add_common_args(
        p,
        json=True,
        json_help="rows: one per (kind, clients); recorded; edge_over_ar",
        tokens=64,
        tokens_help="new tokens per generation",
        prompt_file=True,
        no_progress=True,
    )
    p.add_argument(
        "--flat-ms",
        type=float,
        default=30.0,
        help="the flat verifier's forward ms (the GPU-shaped prediction)",
    )
    p.add_argument(
        "--scripts",
        type=Path,
        default=None,
        help="the recorded scripts: read them from this file if it exists (skipping the record phase), "
        "else record and write them there",
    )
    p.add_argument("--plot", type=Path, default=None, help="draw verifier-seconds per token against clients")
    p.add_argument(
        "--flat-only",
        action="store_true",
        help="run nothing on this machine: read the --scripts file of an earlier run and print the flat "
        "verifier's prediction alone, at --flat-ms (e.g. the forward ms a GPU check measured) for each "
        "--clients",
    )


def ratios(rows: Sequence[dict[str, Any]], key: str) -> dict[int, float | None]:
    """edge / ar of `key` at each client count."""
    by = {(r["kind"], r["clients"]): r.get(key) for r in rows}
    out: dict[int, float | None] = {}
    for m in sorted({r["clients"] for r in rows}):
        e, a = by.get(("edge", m)), by.get(("ar", m))
        out[m] = round(e / a, 3) if e and a else None
    return out


def plot(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind, color in (("ar", "tab:gray"), ("edge", "tab:blue")):
        rs = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["clients"])
        ms = [r["clients"] for r in rs]
        axes[0].plot(
            ms,
            [(r["verifier_s_per_token"] or math.nan) * 1e3 for r in rs],
            "o-",
            color=color,
            label=f"{kind}, this CPU",
        )
        axes[1].plot(
            ms, [r["flat_verifier_s_per_token"] * 1e3 for r in rs], "o--", color=color, label=f"{kind}, flat"
        )
    axes[0].set_title("measured (verifier on one core)")
    axes[1].set_title("predicted, flat cost curve")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("verifier ms per generated token")
        ax.legend()
        ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=110)


def recorded_scripts(
    a: argparse.Namespace,
    url: str,
    prompts: Sequence[BenchPrompt],
    config: dict[str, Any],
) -> tuple[bytes, list[Script]]:
    """The hello frame and the scripts: read from --scripts when that file exists, else recorded
    against the verifier at `url` by a real edge client (config["drafter"]: the backend that
    drafted) and, with --scripts, written there."""
    if a.scripts is not None and a.scripts.exists():
        try:
            hello, scripts, recorded = load_scripts(a.scripts)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        print(f"scripts: {len(scripts)} generations from {a.scripts} (recorded with {recorded.get('mode')})")
        return hello, scripts
    from edge_client.drafters.registry import create_drafter

    drafter = create_drafter(a.drafter, a.draft, n_threads=1)
    config["drafter"] = drafter.name
    try:
        hello, scripts = asyncio.run(
            record(
                url,
                drafter,
                prompts,
                a.tokens,
                a.mode,
                a.tree,
                a.rtt_ms,
                a.temperature,
                not a.no_progress,
            )
        )
    finally:
        drafter.close()
    if a.scripts is not None:
        save_scripts(a.scripts, hello, scripts, config)
    return hello, scripts


def replay_rows(
    verifier: Verifier,
    hello: bytes,
    scripts: Sequence[Script],
    clients: Sequence[int],
    warmup: float,
    seconds: float,
    flat_ms: float,
    progress: bool,
) -> list[dict[str, Any]]:
    """One row per (clients, kind): the scripts replayed against the verifier (`measure`; ar
    clients replay them as mode ar) and the flat verifier's prediction for the same clients."""
    ar_scripts = [s.as_ar() for s in scripts]
    rows: list[dict[str, Any]] = []
    runs = [(m, k) for m in clients for k in KINDS]
    bar = tqdm(total=len(runs), desc="replay", disable=not progress, file=sys.stderr)
    for m, kind in runs:
        row = asyncio.run(
            measure(
                verifier.url,
                verifier.http,
                hello,
                ar_scripts if kind == "ar" else scripts,
                m,
                warmup,
                seconds,
            )
        )
        rows.append({"kind": kind, **row, **flat_prediction(scripts, kind, m, flat_ms, seconds)})
        bar.update(1)
    bar.close()
    return rows


def flat_prediction(
    scripts: Sequence[Script], kind: str, clients: int, flat_ms: float, seconds: float
) -> dict[str, float]:
    """The flat verifier's prediction (predict_flat) for `clients` of `kind` (ar clients replay the
    scripts as mode ar)."""
    games = [flat_rounds(s.as_ar() if kind == "ar" else s, kind == "ar") for s in scripts]
    flat = predict_flat(games, clients, flat_ms / 1e3, max(600.0, 50 * seconds))
    return {
        "flat_verifier_s_per_token": round(flat["verifier_s_per_token"], 5),
        "flat_tokens_per_forward": round(flat["tokens_per_forward"], 3),
    }


def flat_only(a: argparse.Namespace, config: dict[str, Any]) -> Result:
    """--flat-only: the flat verifier's prediction from the --scripts file, nothing run here."""
    if a.scripts is None or not a.scripts.exists():
        raise UsageError(
            "--flat-only reads the scripts an earlier run recorded: give --scripts FILE (an existing file)"
        )
    try:
        _, scripts, recorded_config = load_scripts(a.scripts)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config["recorded_config"] = recorded_config
    rows = [
        {"kind": kind, "clients": m, **flat_prediction(scripts, kind, m, a.flat_ms, a.seconds)}
        for m in a.clients
        for kind in KINDS
    ]
    lines = [
        table(
            [
                [
                    r["clients"],
                    r["kind"],
                    f"{r['flat_verifier_s_per_token'] * 1e3:.2f}",
                    r["flat_tokens_per_forward"],
                ]
                for r in rows
            ],
            ["clients", "kind", f"flat {a.flat_ms:g} ms: verifier ms/token", "flat tokens/forward"],
        )
    ]
    flat_ratio = ratios(rows, "flat_verifier_s_per_token")
    for m in sorted(flat_ratio):
        lines.append(
            f"{m} clients: edge / ar verifier-s a token {flat_ratio[m]} predicted flat "
            f"({len(scripts)} scripts)"
        )
    flat16 = flat_ratio.get(16)
    if flat16 is not None:
        lines.append(
            f"goal: <= 0.2 predicted flat with 16 clients: {'met' if flat16 <= 0.2 else 'not met'} ({flat16})"
        )
    return Result(rows, "\n".join(lines), extra={"edge_over_ar": {"flat": flat_ratio}}, config=config)


def render_table(rows: Sequence[dict[str, Any]], flat_ms: float) -> str:
    """The rows as the printed table (measured, then the flat verifier's prediction)."""
    return table(
        [
            [
                r["clients"],
                r["kind"],
                f"{r['verifier_s_per_token'] * 1e3:.1f}" if r["verifier_s_per_token"] else "-",
                r["tokens_per_forward"],
                f"{r['verifier_busy']:.2f}",
                r["client_ms_per_token"],
                r["V_ms"] if r["V_ms"] is not None else "-",
                f"{r['flat_verifier_s_per_token'] * 1e3:.2f}",
                r["flat_tokens_per_forward"],
                r["diverged"],
                r["errors"],
            ]
            for r in rows
        ],
        [
            "clients",
            "kind",
            "verifier ms/token",
            "tokens/forward",
            "busy",
            "client ms/token",
            "V ms/round",
            f"flat {flat_ms:g} ms: verifier ms/token",
            "flat tokens/forward",
            "diverged",
            "errors",
        ],
    )


def goal_lines(measured: dict[int, float | None], flat_ratio: dict[int, float | None]) -> str:
    """edge / ar of verifier-seconds a token at each client count, and the goals at 16 clients."""
    lines = [
        f"{m} clients: edge / ar verifier-s a token {measured[m]} here, {flat_ratio[m]} flat"
        for m in sorted(measured)
    ]
    goal16 = measured.get(16)
    if goal16 is not None:
        verdict = "met" if goal16 <= 1 / 3 else "not met"
        lines.append(f"goal: <= 0.333 with 16 clients on this CPU: {verdict} ({goal16})")
    flat16 = flat_ratio.get(16)
    if flat16 is not None:
        verdict = "met" if flat16 <= 0.2 else "not met"
        lines.append(f"goal: <= 0.2 predicted flat with 16 clients: {verdict} ({flat16})")
    return "\n".join(lines)


def run(a: argparse.Namespace) -> Result:
    from bench.end_to_end.e2e import ALL_MODES
    from edge_client.defaults import recommended_tree

    if a.mode not in ALL_MODES or a.mode == "ar":
        edge_modes = ", ".join(m for m in ALL_MODES if m != "ar")
        raise UsageError(f"--mode: {a.mode!r} is not an edge mode; choose from {edge_modes}")
    a.tree = a.tree or recommended_tree(a.draft)
    split = CoreSplit.auto()
    print(
        split.describe() + "; in the replay the clients (frame players) stay on the edge's cores", flush=True
    )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "prompt_file"}
    config["prompt_files"] = [str(f) for f in a.prompt_file or []]
    if a.flat_only:
        return flat_only(a, config)
    prompts = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    sessions = 2 * max(a.clients) + 4
    verifier = Verifier(
        a.model, cores=split.verifier, threads=len(split.verifier), args=["--max-sessions", str(sessions)]
    )
    with verifier:
        split.pin_edge()
        hello, scripts = recorded_scripts(a, verifier.url, prompts, config)
        recorded_ms = statistics.median(s.ms_per_token for s in scripts)
        tau = sum(len(s.tokens) for s in scripts) / max(1, sum(len(s.verdicts) - 1 for s in scripts))
        print(
            f"recorded: {len(scripts)} generations, median {recorded_ms:.0f} ms/token with one client, "
            f"{tau:.2f} tokens a tree round",
            flush=True,
        )
        rows = replay_rows(
            verifier, hello, scripts, a.clients, a.warmup, a.seconds, a.flat_ms, not a.no_progress
        )
    measured, flat_ratio = ratios(rows, "verifier_s_per_token"), ratios(rows, "flat_verifier_s_per_token")
    recording = {"generations": len(scripts), "ms_per_token": recorded_ms, "tau": tau}
    return Result(
        rows,
        f"{render_table(rows, a.flat_ms)}\n{goal_lines(measured, flat_ratio)}",
        extra={"recorded": recording, "edge_over_ar": {"measured": measured, "flat": flat_ratio}},
        config=config,
        plot=lambda path: plot(path, rows),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
