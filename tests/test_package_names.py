"""The project's top-level import names belong to it alone.

A top-level package that shares its name with another installed distribution shadows that
distribution (the repository root is first on `sys.path`) or is shadowed by it. This happened: the
compute kernels were a top-level `kernels` package, transformers 5.25 started importing the PyPI
distribution `kernels` whenever it is installed, and every transformers model load in a fresh
install failed with an ImportError. The packages are read from pyproject.toml, the owners of each
import name from the installed distributions' metadata.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_DISTRIBUTION = "treespec"


def project_packages() -> list[str]:
    """The top-level packages pyproject.toml ships (its `packages.find` include patterns)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[tool.setuptools.packages.find]", 1)[1]
    match = re.search(r"^include\s*=\s*\[([^\]]*)\]", section, re.M)
    assert match, "pyproject.toml: [tool.setuptools.packages.find] has no include list"
    include = re.findall(r'"([^"]+)"', match.group(1))
    names = [pattern.rstrip("*") for pattern in include]
    assert names and all(name.isidentifier() for name in names), include
    return names


def clashes(owners: Mapping[str, list[str]], packages: list[str]) -> dict[str, list[str]]:
    """package -> the other distributions that also install a top-level module of that name."""
    found = {}
    for name in packages:
        others = sorted({d for d in owners.get(name, []) if d.lower() != PROJECT_DISTRIBUTION})
        if others:
            found[name] = others
    return found


def test_the_check_sees_a_clash() -> None:
    owners = {"kernels": ["kernels"], "shared": ["treespec", "treespec"]}
    assert clashes(owners, ["kernels", "shared", "bench"]) == {"kernels": ["kernels"]}


def test_no_installed_distribution_ships_a_project_package_name() -> None:
    packages = project_packages()
    assert "treespec_kernels" in packages and "edge_client" in packages
    found = clashes(importlib.metadata.packages_distributions(), packages)
    assert not found, f"top-level names also installed by other distributions (rename ours): {found}"
