"""The project's top-level import names belong to it alone.

A top-level package that shares its name with another installed distribution shadows that
distribution (the repository root is first on `sys.path`) or is shadowed by it. This happened: the
compute kernels were a top-level `kernels` package, transformers 5.25 started importing the PyPI
distribution `kernels` whenever it is installed, and every transformers model load in a fresh
install failed with an ImportError. The packages are read from pyproject.toml, the owners of each
import name from the installed distributions' metadata.
"""

from __future__ import annotations

import ast
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


PRODUCT = ("edge_client", "cloud_verifier", "shared", "treespec_kernels")


def class_homes(root: Path, packages: tuple[str, ...] = PRODUCT) -> dict[str, list[str]]:
    """Top-level class name -> the product modules that define one of that name."""
    homes: dict[str, list[str]] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef):
                    homes.setdefault(node.name, []).append(str(path.relative_to(root)))
    return homes


def test_no_two_product_classes_share_a_name() -> None:
    """Two meanings under one name (two Session, two Refused, three Outcome, two Generation) make a
    reader guess which is meant; the verifier's were renamed (ServerSession, AdmissionRefused,
    CaseOutcome, ServerGeneration, CompletionRun), the SDK's public names stayed."""
    twice = {name: where for name, where in class_homes(ROOT).items() if len(where) > 1}
    assert not twice, f"class names defined in more than one product module: {twice}"


def test_the_class_scan_sees_a_clash(tmp_path: Path) -> None:
    for pkg in ("a", "b"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "m.py").write_text("class Session:\n    pass\n", encoding="utf-8")
    assert class_homes(tmp_path, ("a", "b")) == {"Session": ["a/m.py", "b/m.py"]}
