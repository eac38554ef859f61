"""Where model files live: the cache directory, an installed package's copy, pip's extra arguments.

Environment variables of the store are read here only ($TREESPEC_CACHE, $XDG_CACHE_HOME,
$TREESPEC_PIP_ARGS).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from pathlib import Path

from shared.model_store.catalog import ModelFile


def cache_dir() -> Path:
    """The treespec cache directory (created if missing)."""
    root = os.environ.get("TREESPEC_CACHE")
    if root:
        path = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg) if xdg else Path.home() / ".cache") / "treespec"
    path.mkdir(parents=True, exist_ok=True)
    return path


def pip_extra_args() -> list[str]:
    """Extra arguments for every pip command of the store ($TREESPEC_PIP_ARGS)."""
    return shlex.split(os.environ.get("TREESPEC_PIP_ARGS", ""))


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def installed_copy(mf: ModelFile) -> Path | None:
    """The file inside an installed package (found without importing it), if there is one."""
    if mf.installed is None:
        return None
    try:
        spec = importlib.util.find_spec(mf.installed)
    except (ImportError, ValueError):
        return None
    for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / mf.filename
        if path.is_file():
            return path
    return None


def cached_path(mf: ModelFile) -> Path:
    """Where the store keeps `mf` (it may not exist yet)."""
    return models_dir() / mf.filename
