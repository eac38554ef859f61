"""What an interrupted generation lost: its record against the uninterrupted run, and a run's
figures over every record (`bench.chaos`, `bench.chaos --fleet`, `bench.fleet`'s resume part)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.lib.stats import median


def record(mode: str, want: list[int], got: list[int], resumes: list[float]) -> dict[str, Any]:
    """One interrupted generation against its uninterrupted run: identical, tokens lost and
    repeated past the first difference, and the resumes' times (ms)."""
    n = min(len(got), len(want))
    same = next((j for j in range(n) if got[j] != want[j]), n)
    return {
        "mode": mode,
        "identical": got == want,
        "tokens_lost": max(0, len(want) - same) if got != want else 0,
        "tokens_repeated": max(0, len(got) - same) if got != want else 0,
        "resumes": len(resumes),
        "resume_ms": [round(r * 1e3, 1) for r in resumes],
    }


def summary(records: Sequence[dict[str, Any]], kills: int) -> dict[str, Any]:
    """The figures of the run (the printed table) from every generation's record."""
    resume_ms = sorted(x for r in records for x in r["resume_ms"])
    return {
        "kills": kills,
        "generations": 2 * len(records),
        "identical": all(r["identical"] for r in records),
        "tokens_lost": sum(r["tokens_lost"] for r in records),
        "tokens_repeated": sum(r["tokens_repeated"] for r in records),
        "resume_ms_median": median(resume_ms, 1),
        "resume_ms_p95": round(resume_ms[min(len(resume_ms) - 1, int(0.95 * len(resume_ms)))], 1)
        if resume_ms
        else None,
        "resumed_generations": sum(1 for r in records if r["resumes"]),
    }
