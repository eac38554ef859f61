"""The project's benchmarks, robustness runs, exactness proofs and developer tools, as one tool.

`python -m bench` lists them (bench/registry.py) and `python -m bench NAME` runs one. They live in
folders by kind (end_to_end, serving, kernels, simulation, training, robustness, exactness, tools),
over a shared library (bench/lib).

The short names stay importable and runnable: `python -m bench.network` and `import bench.network`
are `bench.end_to_end.network`. A finder placed last on `sys.meta_path` maps `bench.NAME` to the one
module of that name in a kind's folder (or in bench/lib), so commands written with the short names
keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import CodeType, ModuleType

# the folders a short name is looked up in, in this order (a name is in one of them only)
FOLDERS = (
    "end_to_end",
    "serving",
    "kernels",
    "simulation",
    "training",
    "robustness",
    "exactness",
    "tools",
    "lib",
)

_HERE = Path(__file__).resolve().parent

# short names of modules that live outside bench/: the demo is a product entry point
ELSEWHERE = {"demo": "treespec_demo.demo"}


def full_name(short: str) -> str | None:
    """`bench.<folder>.<short>` for the module file bench/<folder>/<short>.py (or the module named
    in ELSEWHERE), or None."""
    if short in ELSEWHERE:
        return ELSEWHERE[short]
    for folder in FOLDERS:
        if (_HERE / folder / f"{short}.py").is_file():
            return f"bench.{folder}.{short}"
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads `bench.NAME` as the module it stands for: an import gets that very module object (one
    module, not a copy), and `python -m bench.NAME` runs that module's code as __main__."""

    def __init__(self, real: str) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.real)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: create_module returned the real module, already executed."""

    def get_code(self, fullname: str) -> CodeType | None:
        spec = importlib.util.find_spec(self.real)
        if spec is None or not isinstance(spec.loader, importlib.abc.InspectLoader):
            raise ImportError(f"cannot load {self.real} (for {fullname})", name=fullname)
        return spec.loader.get_code(self.real)

    def is_package(self, fullname: str) -> bool:
        return False


class _ShortNames(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, short = fullname.partition(".")
        if prefix != "bench" or not short or "." in short:
            return None
        real = full_name(short)
        if real is None:
            return None
        spec = importlib.util.find_spec(real)
        origin = spec.origin if spec is not None else None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), origin=origin)


if not any(isinstance(f, _ShortNames) for f in sys.meta_path):
    sys.meta_path.append(_ShortNames())
