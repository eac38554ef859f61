"""Imports every module of the named packages and fails when one cannot be imported for a reason
other than an optional dependency that is not installed (a module of the project that moved or
was renamed, a name that no longer exists, a syntax error).

    python scripts/import_check.py shared cloud_verifier treespec_kernels

The container images run it at build time, so a moved module breaks the build rather than the
first request; tests run it over the development environment.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback

PROJECT = ("shared", "cloud_verifier", "edge_client", "treespec_kernels", "bench")


def check(packages: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(imported, skipped for a missing optional dependency, failed with the reason)."""
    ok: list[str] = []
    skipped: list[str] = []
    failed: list[str] = []
    names: list[str] = []
    for pkg in packages:
        root = importlib.import_module(pkg)
        names.append(pkg)
        # __main__ modules run their command line when imported: not imported here
        names += [
            m.name for m in pkgutil.walk_packages(root.__path__, pkg + ".") if not m.name.endswith("__main__")
        ]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if missing and missing not in PROJECT:
                skipped.append(f"{name} (needs {missing}, not installed)")
            else:
                failed.append(f"{name}: {exc}")
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            failed.append(f"{name}: {type(exc).__name__}: {exc} ({last.filename}:{last.lineno})")
        else:
            ok.append(name)
    return ok, skipped, failed


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python scripts/import_check.py PACKAGE [PACKAGE ...]", file=sys.stderr)
        return 2
    ok, skipped, failed = check(argv)
    for line in skipped:
        print(f"skipped {line}")
    for line in failed:
        print(f"FAILED  {line}", file=sys.stderr)
    print(f"import check: {len(ok)} modules imported, {len(skipped)} skipped, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
