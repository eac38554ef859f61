"""The one way a benchmark runs: `add_args(parser)` declares its flags, `run(args) -> Result` measures,
and `main` does the rest the same way for every benchmark.

A benchmark module:

    def add_args(ap: argparse.ArgumentParser) -> None: ...   # its flags (--json, --plot included)
    def run(args: argparse.Namespace) -> Result: ...         # the measurement; no printing of the
                                                             # final table, no writing of --json
    def main(argv: Sequence[str] | None = None) -> int:
        return runner.main(__name__, argv)

`main` builds the parser (prog `python -m bench NAME`, the description from the module's docstring),
parses, calls `run`, prints `Result.table`, writes `--json` as the {"config", "rows", "complete"}
envelope (`write_result`, with `Result.extra` beside), draws `--plot` with `Result.plot` and returns
`Result.status`. A `UsageError` raised by `run` (a flag value the parser could not check alone)
ends as the parser's own error: usage, the message, exit status 2.

A benchmark that rewrites its --json while rows come in (long runs) calls `write_result(args.json,
args, rows, False)` itself; the runner's final write sets `complete`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.lib.results import write_result


class UsageError(ValueError):
    """A flag's value `run` found wrong: the runner reports it as the parser reports a bad flag."""


@dataclass
class Result:
    """What a benchmark's `run` measured.

    rows: the result rows (one mapping per row of the table): the JSON's "rows".
    table: the text printed at the end (a rendered table and any summary lines under it).
    complete: False when the run stopped before every planned row (the JSON's "complete").
    extra: the benchmark's own keys in the JSON beside config, rows and complete.
    config: the JSON's "config"; None takes the parsed flags.
    plot: draws the figure --plot names (called with that path), where the benchmark has --plot.
    status: the exit status (0: the run did what was asked, checks included).
    """

    rows: Sequence[Mapping[str, object]]
    table: str = ""
    complete: bool = True
    extra: dict[str, object] = field(default_factory=dict)
    config: Mapping[str, object] | None = None
    plot: Callable[[Path], object] | None = None
    status: int = 0


def _module(name_or_module: str | ModuleType) -> ModuleType:
    if isinstance(name_or_module, ModuleType):
        return name_or_module
    return sys.modules[name_or_module]


def short_name(module: ModuleType) -> str:
    """The name `python -m bench NAME` takes: the module's last part (its file's stem when it runs
    as __main__)."""
    spec = getattr(module, "__spec__", None)
    name = spec.name if spec is not None else module.__name__
    if name == "__main__":
        name = Path(getattr(module, "__file__", "bench")).stem
    return name.rsplit(".", 1)[-1]


def build_parser(module: str | ModuleType, prog: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's parser: its prog (`prog`, else `python -m bench NAME`) and description, then
    its own `add_args`."""
    mod = _module(module)
    doc = (mod.__doc__ or "").strip()
    ap = argparse.ArgumentParser(
        prog=prog or f"python -m bench {short_name(mod)}",
        description=doc.split("\n\n")[0] if doc else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    mod.add_args(ap)
    return ap


def main(module: str | ModuleType, argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the benchmark `module` (its name, as `__name__` gives it, or the module) on `argv`;
    `prog` names the command in usage and errors (default: `python -m bench NAME`)."""
    mod = _module(module)
    ap = build_parser(mod, prog)
    args = ap.parse_args(argv)
    try:
        result: Result = mod.run(args)
    except UsageError as e:
        ap.error(str(e))
    if not isinstance(result, Result):
        raise TypeError(f"{short_name(mod)}.run returned {type(result).__name__}, not a Result")
    if result.table:
        print(result.table, flush=True)
    json_path = getattr(args, "json", None)
    if json_path is not None:
        config: Mapping[str, Any] | argparse.Namespace = args if result.config is None else result.config
        write_result(json_path, config, list(result.rows), result.complete, **result.extra)
        print(f"wrote {json_path}", flush=True)
    plot_path = getattr(args, "plot", None)
    if plot_path is not None and result.plot is not None:
        result.plot(Path(plot_path))
        print(f"wrote {plot_path}", flush=True)
    return result.status
