"""The result files of the benches: every bench's --json is {"config", "rows", "complete"} and its
own keys (`write_result`); other JSON files (traces, curves, recorded scripts) go through
`write_json`; a bench made in pieces is read back with `read_runs`; a plot ends in `save_figure`;
a printed table is `table`."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib loads only in the benches that draw
    from matplotlib.figure import Figure

RESULT_KEYS = ("config", "rows", "complete")  # the envelope of every result file (write_result)


def _jsonable(value: object) -> object:
    """json's `default`: a path as its text, an enum as its value, a numpy scalar or array as its
    Python number or list; anything else it cannot hold is a TypeError naming the type."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Enum):
        return value.value
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} cannot be written to JSON: {value!r:.80}")


def write_json(path: str | os.PathLike[str], doc: object, *, indent: int | None = None) -> Path:
    """Write a JSON file that is not a bench's result (a trace, recorded scripts, a curve file:
    the inputs of other benches, each with its own format): built whole first (paths as text),
    then replacing the file at once, its folder made. Result files go through write_result."""
    text = json.dumps(doc, indent=indent, default=_jsonable) + "\n"
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out


def write_result(
    path: str | os.PathLike[str] | None,
    config: Mapping[str, object] | argparse.Namespace,
    rows: Sequence[Mapping[str, object]],
    complete: bool,
    /,
    **extra: object,
) -> Path | None:
    """Write a bench's result file (its --json): {"config": the run's settings (a Namespace is
    taken as vars()), "rows": the per-row results its table shows, "complete": True once every
    planned row has finished (False in a file rewritten as rows come in)}, then the bench's own
    keys (`extra`: whatever its earlier files held and its readers use). Nothing is written when
    `path` is None (no --json). Paths are written as text, enums as their values, numpy scalars
    and arrays as numbers and lists; NaN stays NaN (Python's json reads it). Returns the path.

    Refused before the file is touched (TypeError or ValueError): `complete` that is not a bool, a
    config that is not a mapping of str keys, rows that are not a list (or tuple) of mappings of
    str keys, an extra key that is one of RESULT_KEYS, a value JSON cannot hold."""
    cfg = vars(config) if isinstance(config, argparse.Namespace) else config
    if not isinstance(complete, bool):
        raise TypeError(f"complete must be a bool, got {type(complete).__name__}")
    if not isinstance(cfg, Mapping) or not all(isinstance(k, str) for k in cfg):
        raise TypeError(f"config must be a mapping of str keys, got {type(cfg).__name__}")
    if not isinstance(rows, (list, tuple)):
        raise TypeError(f"rows must be a list of mappings, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or not all(isinstance(k, str) for k in row):
            raise TypeError(f"rows[{i}] must be a mapping of str keys, got {type(row).__name__}")
    clash = sorted(set(extra) & set(RESULT_KEYS))
    if clash:
        raise ValueError(f"{', '.join(clash)}: the envelope's own keys, not extra keys")
    if path is None:
        return None
    doc = {"config": dict(cfg), "rows": list(rows), "complete": complete, **extra}
    return write_json(path, doc, indent=2)


def figure_rows(figures: Mapping[str, object]) -> list[dict[str, object]]:
    """The rows of a figure / value table (chaos, fuzz, soak), as printed: one {figure, value} each."""
    return [{"figure": k, "value": v} for k, v in figures.items()]


def save_figure(fig: Figure, path: str | os.PathLike[str], *, dpi: int) -> Path:
    """The end of every bench's plot: tight layout, the folder made, the PNG written, the figure
    closed (pyplot keeps every open figure otherwise)."""
    import matplotlib.pyplot as plt

    out = Path(path)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def read_runs(
    paths: Sequence[str], bench: str, key: str, kind: type, missing: str, same_run: Sequence[str]
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """The `--json` files of one bench made in pieces (`--merge`): each (path, document), and the
    first file's config. A file that cannot be read, lacks `key` of type `kind` (`missing` says so)
    or was run with other settings (`same_run` keys of its config) is a ValueError naming it."""
    if not paths:
        raise ValueError("name at least one JSON file")
    docs: list[tuple[str, dict[str, Any]]] = []
    first: dict[str, Any] | None = None
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a {bench} JSON file ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get(key), kind):
            raise ValueError(f"{path}: {missing}")
        cfg = doc.get("config") or {}
        if first is None:
            first = cfg
        diff = [k for k in same_run if cfg.get(k) != first.get(k)]
        if diff:
            raise ValueError(
                f"{path} was run with other settings than {paths[0]}: "
                + ", ".join(f"{k} {cfg.get(k)!r} vs {first.get(k)!r}" for k in diff)
            )
        docs.append((path, doc))
    assert first is not None
    return docs, first


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain text table."""
    cells = [[str(h) for h in header]] + [
        [f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
