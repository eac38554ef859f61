"""Drafts a user trained, by a name of their own: `draft-training export --run RUN --name NAME`
writes `<cache>/models/trained/NAME.gguf`, and `resolve` (so `--draft NAME` in every drafter
backend) finds it when NAME is neither an alias nor a path."""

from __future__ import annotations

import re
from pathlib import Path

from shared.model_store.catalog import ALIASES
from shared.model_store.paths import models_dir

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def check_name(name: str) -> str:
    """`name` when it can name a trained draft: lower-case letters, digits, `.`, `_`, `-` (64 at
    most, a letter or digit first), not an alias of the store; else ValueError saying why."""
    if not _NAME.fullmatch(name) or name.endswith(".gguf"):
        raise ValueError(
            "a trained draft's name is 1-64 of a-z 0-9 . _ - (a letter or digit first, no .gguf), "
            f"got {name!r}"
        )
    if name in ALIASES:
        raise ValueError(f"{name!r} is an alias of the model store; choose another name for a trained draft")
    return name


def trained_dir() -> Path:
    path = models_dir() / "trained"
    path.mkdir(parents=True, exist_ok=True)
    return path


def trained_path(name: str) -> Path:
    """Where the trained draft `name` lives (whether it exists or not)."""
    return trained_dir() / f"{check_name(name)}.gguf"


def trained_names() -> list[str]:
    """The names of the trained drafts in the cache."""
    return sorted(p.stem for p in trained_dir().glob("*.gguf") if _NAME.fullmatch(p.stem))


def find_trained(name: str) -> Path | None:
    """The file of the trained draft `name`, or None when there is none (or it is not a name)."""
    try:
        path = trained_path(name)  # check_name's rule, the one the export applies
    except ValueError:
        return None
    return path if path.is_file() else None
