"""From a name to a verified file on this machine: aliases are fetched or derived on first use."""

from __future__ import annotations

import os
from pathlib import Path

from shared.model_store.catalog import ALIASES, FILES, ModelFile, ModelNotFoundError, aliases, model_file
from shared.model_store.derive import truncated_gguf
from shared.model_store.fetch import fetch as fetch_file
from shared.model_store.paths import cached_path, installed_copy
from shared.model_store.trained import find_trained, trained_names
from shared.model_store.verify import check_file, locked, stamp_ok


def local_path(alias: str) -> Path | None:
    """The file of `alias` if it is on this machine already (nothing fetched, nothing hashed)."""
    mf = model_file(alias)
    found = installed_copy(mf)
    if found is not None:
        return found
    path = cached_path(mf)
    return path if path.is_file() else None


def resolve(
    name_or_path: str | os.PathLike[str],
    role: str | None = None,
    *,
    fetch: bool = True,
    progress: bool = True,
) -> Path:
    """An alias (fetched on first use) or a path to an existing file -> the model file's path.

    role: when given, an alias of another role is refused with the aliases of this role listed.
    """
    name = str(name_or_path)
    if name in ALIASES:
        if role is not None and role not in ALIASES[name].roles:
            raise ModelNotFoundError(
                f"{name!r} is a {'/'.join(ALIASES[name].roles)} alias, not a {role}; "
                f"{role} aliases: {', '.join(aliases(role))}"
            )
        return ensure(name, fetch=fetch, progress=progress)
    path = Path(name).expanduser()
    if path.is_file():
        return path
    trained = find_trained(name) if role in (None, "draft") else None
    if trained is not None:
        return trained
    known = ", ".join(aliases(role))
    what = f"{role} model" if role else "model"
    names = trained_names() if role in (None, "draft") else []
    own = f", nor a trained draft's name ({', '.join(names)})" if names else ""
    raise ModelNotFoundError(f"{what} {name!r} is neither an alias ({known}){own} nor an existing file")


def ensure(alias: str, *, fetch: bool = True, progress: bool = True) -> Path:
    """The verified file of `alias`, fetched (or derived) first when it is not on this machine."""
    mf = model_file(alias)
    found = installed_copy(mf)
    if found is not None:
        return found
    return ensure_file(mf, fetch=fetch, progress=progress)


def ensure_file(mf: ModelFile, *, fetch: bool = True, progress: bool = True) -> Path:
    dst = cached_path(mf)
    if dst.is_file() and stamp_ok(mf, dst):
        return dst
    if mf.kind == "trained":  # made here by training, never fetched
        names = [a.name for a in ALIASES.values() if a.file == mf.filename]
        raise ModelNotFoundError(
            f"{' / '.join(names) or mf.filename} is a draft trained on this machine and is not built yet "
            f"({dst} is missing): run `make drafts` (about an hour on 2 cores; "
            "`python -m draft_training drafts --help`)"
        )
    with locked(dst):  # a second process fetching the same file waits, then finds it
        if dst.is_file():
            if mf.verifiable and not stamp_ok(mf, dst):
                check_file(mf, dst, progress=progress)
            return dst
        if not fetch:
            raise ModelNotFoundError(
                f"{mf.filename} is not in the model cache ({dst.parent}); fetch it with "
                f"`python -m shared.model_store fetch` or `make models`"
            )
        if mf.kind == "derived":
            assert mf.source is not None and mf.blocks is not None
            src = installed_copy(FILES[mf.source]) or ensure_file(FILES[mf.source], progress=progress)
            truncated_gguf(src, dst, mf.blocks)
        else:
            fetch_file(mf, dst, progress)
    return dst
