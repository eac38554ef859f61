"""bench.lib's small pieces: the median, the nearest-rank percentile, the timed median and the model
flags."""

from __future__ import annotations

import argparse

import pytest

from bench.lib.args import add_model_args
from bench.lib.stats import median, median_ms, percentile


def test_median_rounds_when_asked_and_is_none_when_empty() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median(iter([1.0, 2.0])) == 1.5
    assert median([1.0, 2.0, 2.12345], 2) == 2.0 and median([0.123456], 4) == 0.1235
    assert median([]) is None and median([], 1) is None


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (
        percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    )
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


def test_median_ms_warms_up_and_syncs_around_each_timed_call() -> None:
    calls: list[str] = []
    ms = median_ms(lambda: calls.append("f"), 3, warmup=2, sync=lambda: calls.append("s"))
    assert ms >= 0.0 and calls == ["f", "f"] + ["s", "f", "s"] * 3


def test_add_model_args_declares_only_what_is_asked_with_its_help() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap, model="m", draft="d", draft_help="the draft", threads=2)
    a = ap.parse_args([])
    assert (a.model, a.draft, a.threads) == ("m", "d", 2)
    assert ap.parse_args(["--threads", "3"]).threads == 3
    text = " ".join(ap.format_help().split())
    assert (
        "target model of the verifier" in text
        and "the draft" in text
        and "torch threads (0: torch's default)" in text
    )
    ap = argparse.ArgumentParser()
    add_model_args(ap, threads=0)
    assert vars(ap.parse_args([])) == {"threads": 0}
    with pytest.raises(SystemExit):
        ap.parse_args(["--model", "x"])


def test_pinned_children_run_on_the_given_cores() -> None:
    import os
    import subprocess
    import sys

    from bench.lib.procs import pinned

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity here")
    core = min(os.sched_getaffinity(0))
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=pinned([core])
    )
    assert run.stdout.strip() == f"[{core}]"
