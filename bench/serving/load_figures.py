"""bench.serving.load's figures: CPU time of this process and of the rest of the machine, percentiles,
the summary of one run, speedups of batched over unbatched runs, and the printed table."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.stats import percentile


@dataclass
class Tally:
    """What the clients of one run saw before the deadline."""

    round_ms: list[float] = field(default_factory=list)  # every round, prompt rounds included
    prompt_ms: list[float] = field(default_factory=list)  # round 0: prefill + the attached tree
    tokens: int = 0
    rounds: int = 0
    prompt_tokens: int = 0  # prefill work sent (prompts whose first verdict came in time)
    sessions_completed: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def verdict(self, ms: float, tokens: int, first: int) -> None:
        """first: the prompt's length on its round-0 verdict, else 0."""
        self.round_ms.append(ms)
        if first:
            self.prompt_ms.append(ms)
            self.prompt_tokens += first
        self.tokens += tokens
        self.rounds += 1

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what)


class OtherCpu:
    """CPU time that other processes used during a run, in cores. The machine is shared: a busy
    neighbour during one run of a batched/unbatched pair skews the ratio, and this shows it."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0 = _machine_busy_s()
        self.own0 = _own_cpu_s()

    def cores(self) -> float | None:
        busy = _machine_busy_s()
        if busy is None or self.busy0 is None:
            return None
        others = (busy - self.busy0) - (_own_cpu_s() - self.own0)
        return max(0.0, others) / max(time.monotonic() - self.t0, 1e-9)


def _machine_busy_s() -> float | None:
    """Seconds all CPUs spent busy since boot (Linux /proc/stat; None elsewhere)."""
    try:
        line = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in line[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def summarize(
    clients: int,
    batching: bool | None,
    seconds: float,
    tally: Tally,
    forwards: int | None,
    others: float | None,
) -> dict[str, Any]:
    run: dict[str, Any] = {
        "clients": clients,
        "batching": batching,
        "sessions_completed": tally.sessions_completed,
        "errors": tally.errors,
        "tokens_per_s": round(tally.tokens / seconds, 2),
        "round_ms_p50": _r(percentile(tally.round_ms, 50)),
        "round_ms_p99": _r(percentile(tally.round_ms, 99)),
        "prompt_round_ms_p50": _r(percentile(tally.prompt_ms, 50)),
        "prefill_tokens": tally.prompt_tokens,
        "rounds": tally.rounds,
        "tokens": tally.tokens,
        "tokens_per_round": round(tally.tokens / tally.rounds, 3) if tally.rounds else None,
        "seconds": seconds,
        "engine_forwards": forwards,
        "rounds_per_forward": round(tally.rounds / forwards, 3) if forwards else None,
        "other_cpu_cores": _r(others, 2),
    }
    if tally.error_samples:
        run["error_samples"] = tally.error_samples
    return run


def speedups(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """tokens/s batched / unbatched, per client count that has both runs."""
    out: dict[str, float | None] = {}
    for on in (r for r in runs if r["batching"] is True):
        off = next((r for r in runs if r["clients"] == on["clients"] and r["batching"] is False), None)
        if off is not None:
            ratio = on["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else None
            out[str(on["clients"])] = _r(ratio, 3)
    return out


def _fmt(x: Any, width: int, nd: int = 1) -> str:
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, float):
        return f"{x:>{width}.{nd}f}"
    return f"{x!s:>{width}}"


# (header, run key, decimals) of the printed table
COLUMNS = (
    ("clients", "clients", 0),
    ("batching", "batching", 0),
    ("sessions", "sessions_completed", 0),
    ("errors", "errors", 0),
    ("rounds", "rounds", 0),
    ("tok/round", "tokens_per_round", 2),
    ("tokens/s", "tokens_per_s", 1),
    ("p50 ms", "round_ms_p50", 1),
    ("p99 ms", "round_ms_p99", 1),
    ("prompt p50", "prompt_round_ms_p50", 1),
    ("prefill tok", "prefill_tokens", 0),
    ("rounds/fwd", "rounds_per_forward", 2),
    ("others cpu", "other_cpu_cores", 2),
)


def render_table(result: dict[str, Any]) -> str:
    """The printed report of bench.serving.load: the setting, one line per run, the batching speed-up
    (or why there is none) and each run's sampled errors."""
    lines = [
        f"\nload: {result['model']} on {result['server']}, {result['seconds']:g} s per run, "
        f"greedy, {result['tokens']} new tokens per generation, prompt-lookup trees of "
        f"<= {result['nodes']} nodes, depth <= {result['depth']}",
        f"cpu: {result['cpu']}",
        " ".join(f"{head:>{max(len(head), 8)}}" for head, _, _ in COLUMNS),
    ]
    for r in result["runs"]:
        row = {**r, "batching": {True: "on", False: "off", None: "server"}[r["batching"]]}
        lines.append(" ".join(_fmt(row[key], max(len(head), 8), nd) for head, key, nd in COLUMNS))
    if result["batching_speedup"]:
        ratios = ", ".join(
            f"{c} clients {_fmt(v, 0, 2).strip()}x" for c, v in result["batching_speedup"].items()
        )
        lines.append(f"batching speedup (tokens/s batched / unbatched): {ratios}")
    else:
        lines.append(
            "no unbatched comparison: the bench drove an external verifier (--url); it can switch "
            "batching off only on a server it starts itself (run without --url)"
        )
    for r in result["runs"]:
        for sample in r.get("error_samples", []):
            lines.append(f"  error ({r['clients']} clients, batching {r['batching']}): {sample}")
    return "\n".join(lines)
