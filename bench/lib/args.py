"""The benches' common flags: one declaration of each, with one name, metavar and help text
everywhere (`add_common_args`, `add_model_args`), the argparse types of comma lists, and the prompt
suite a run's flags choose (`suite_from_args`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from bench.lib.runner import UsageError
from shared.prompts import BenchPrompt, load_prompt_file, load_suite


def add_prompt_file_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--prompt-file",
        type=Path,
        action="append",
        default=None,
        metavar="PATH",
        help="JSONL of your own prompts, used instead of the built-in sets (repeatable): lines of "
        'Spec-Bench\'s form {"question_id", "category", "turns"} (first turn, as a chat turn) or '
        'HumanEval\'s {"task_id", "prompt"} (raw)',
    )


def add_common_args(
    ap: argparse.ArgumentParser,
    *,
    json: bool = False,
    json_help: str = "",
    seed: int | None = None,
    seed_help: str = "",
    tokens: int | None = None,
    tokens_help: str = "",
    prompt_file: bool = False,
    no_progress: bool = False,
) -> None:
    """Declare the flags the benches share, with one name, metavar and help text everywhere; a module
    passes its defaults (`seed`, `tokens`; None: no flag) and what a flag means there (`*_help`):

      --json PATH         the result file, written with write_result (default: none written)
      --seed N            the run's seed (what it seeds: seed_help)
      --tokens N          tokens per prompt or generation (tokens_help)
      --prompt-file PATH  your own prompts instead of the built-in sets (suite_from_args)
      --no-progress       no progress bars (tqdm, on stderr)

    Which bench takes which: `python -m bench NAME --help` (tests/bench/test_harness_shape.py checks
    that no module declares one of these flags itself, and keeps each module's --seed and --tokens
    defaults).

    Left out where it would mean nothing: --prompt-file where no prompt suite runs (kernel and forward
    micro-benchmarks, fuzz, soak, chaos and prefill_share on made-up tokens, load's own --prompt-dir,
    drafter_cost's one prompt, simulate's traces); --seed where nothing is drawn at random or seeds follow
    the prompt index (agreement, network, outcomes, load_cost); --no-progress where no bar is drawn. Not
    benches: gpu_check (its report goes through write_result), netproxy and the libraries (e2e_results,
    network_report, peers_report, load_clients, load_figures, llama_tools, proposer, serve_metrics)."""
    if json:
        what = "write the result to this JSON file ({config, rows, complete} and the bench's own keys)"
        help_ = f"{what}: {json_help}" if json_help else what
        ap.add_argument("--json", type=Path, default=None, metavar="PATH", help=help_)
    if seed is not None:
        ap.add_argument(
            "--seed", type=int, default=seed, metavar="N", help=f"seed: {seed_help}" if seed_help else "seed"
        )
    if tokens is not None:
        ap.add_argument(
            "--tokens", type=int, default=tokens, metavar="N", help=tokens_help or "new tokens per prompt"
        )
    if prompt_file:
        add_prompt_file_arg(ap)
    if no_progress:
        ap.add_argument("--no-progress", action="store_true", help="no progress bars (tqdm, on stderr)")


def add_model_args(
    ap: argparse.ArgumentParser,
    *,
    model: str | None = None,
    model_help: str = "target model of the verifier",
    draft: str | None = None,
    draft_help: str = "draft alias or GGUF path",
    threads: int | None = None,
    threads_help: str = "torch threads (0: torch's default)",
) -> None:
    """Declare --model, --draft and --threads: a module passes its defaults (None: no flag) and what
    the flag means there (`*_help`)."""
    if model is not None:
        ap.add_argument("--model", default=model, help=model_help)
    if draft is not None:
        ap.add_argument("--draft", default=draft, help=draft_help)
    if threads is not None:
        ap.add_argument("--threads", type=int, default=threads, help=threads_help)


def positive_ints(text: str) -> list[int]:
    """An argparse type: a comma list of positive integers, in the order given."""
    return _int_list(text, 1, "positive integers")


def nonnegative_ints(text: str) -> list[int]:
    """An argparse type: a comma list of integers >= 0 (e.g. round trips, 0 meaning direct)."""
    return _int_list(text, 0, "integers of 0 or more")


def _int_list(text: str, minimum: int, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def suite_from_args(humaneval: int, spec_bench: int, files: Sequence[Path] | None) -> list[BenchPrompt]:
    """The prompts of a benchmark run: every --prompt-file in order, else the built-in sets (an
    unreadable or malformed file: a UsageError, which the runner reports as the parser's error)."""
    if not files:
        return load_suite(humaneval, spec_bench)
    try:
        return [p for f in files for p in load_prompt_file(f)]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
