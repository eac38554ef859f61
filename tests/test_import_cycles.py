"""No import cycle in the project's packages, and no import up the layers.

The graph: a node per module (`pkg/__init__.py` is `pkg`); `import a.b` adds an edge to `a.b`;
`from a import b` adds one to `a.b` when that is a module of the project, else to `a` (a name
defined or re-exported by `a`); relative imports are resolved. Every import statement counts:
at module level, inside functions, and under `if TYPE_CHECKING:` (a name a module's annotations
need is a dependency of its design even when it is never imported at run time). The implicit
import of a parent package by its submodules is not an edge: a package's `__init__` re-exporting
its submodules is fine, a submodule taking a name from its own package's `__init__` is not.

The layers, bottom-up (docs/architecture.md §1): `treespec_kernels`, `shared`, then
`edge_client` and `cloud_verifier` side by side (neither imports the other), `draft_training`,
`bench`, and the demo (`treespec_demo`) on top. A module imports its own package and the packages of lower
layers only. `tests/` and
`scripts/` sit above all of them and are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "edge_client",
    "cloud_verifier",
    "shared",
    "treespec_kernels",
    "bench",
    "draft_training",
    "treespec_demo",
)
# bottom-up; packages in one layer may not import each other
LAYERS: tuple[tuple[str, ...], ...] = (
    ("treespec_kernels",),
    ("shared",),
    ("edge_client", "cloud_verifier"),
    ("draft_training",),
    ("bench",),
    ("treespec_demo",),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "results" in path.relative_to(ROOT).parts:
                continue
            found[module_name(path)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its body, TYPE_CHECKING blocks too)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_the_finder_sees_a_cycle_and_a_clean_graph() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _resolve("pkg.sub.mod", False, 2, "other") == "pkg.other"
    assert _resolve("pkg.sub", True, 1, None) == "pkg.sub"


def test_the_graph_sees_imports_inside_functions() -> None:
    graph = import_graph(project_modules(("shared",)))
    assert "treespec_kernels.cpu_attention" not in graph  # only the packages asked for
    assert "shared.model.llama" in graph["shared.model"]
    assert graph["shared.model.llama"] >= {"shared.model.kv_cache", "shared.model.attention"}
    # weight_cache.py imports build_model inside a function
    assert "shared.model.weights" in graph["shared.model.weight_cache"]


def test_no_import_cycle() -> None:
    cycles = find_cycles(import_graph(project_modules()))
    assert cycles == [], f"import cycles: {cycles}"


def test_tensor_parallel_serving_depends_on_the_server_one_way() -> None:
    """`serve_parallel` starts the server (an import inside a function) and hands it its loader, so
    the server importing anything of cloud_verifier.parallel would be a cycle."""
    graph = import_graph(project_modules(("cloud_verifier",)))
    assert "cloud_verifier.server" in graph["cloud_verifier.parallel.service"]
    assert not any(m.startswith("cloud_verifier.parallel") for m in graph["cloud_verifier.server"])


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def layer_violations(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every edge from a package to one of a higher layer or to another package of its own layer."""
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    out = []
    for m in graph:
        src = m.split(".")[0]
        for w in graph[m]:
            dst = w.split(".")[0]
            if dst != src and rank[dst] >= rank[src]:
                out.append(f"{m} -> {w}")
    return sorted(out)


def test_the_layer_check_sees_upward_and_sideways_imports() -> None:
    graph = {
        "shared.x": {"treespec_kernels.k", "shared.y"},
        "shared.y": set(),
        "treespec_kernels.k": set(),
        "edge_client.a": {"shared.x"},
        "edge_client.b": {"cloud_verifier.v"},
        "cloud_verifier.v": {"shared.y"},
        "draft_training.d": {"bench.h", "edge_client.a"},
        "bench.h": {"draft_training.d"},
    }
    assert layer_violations(graph) == ["draft_training.d -> bench.h", "edge_client.b -> cloud_verifier.v"]
    assert layer_violations({"treespec_kernels.k": {"shared.x"}, "shared.x": set()}) == [
        "treespec_kernels.k -> shared.x"
    ]
    assert reaches({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}


def test_the_graph_counts_type_checking_and_function_imports(tmp_path: Path) -> None:
    (tmp_path / "low.py").write_text("X = 1\n")
    (tmp_path / "mid.py").write_text("def f() -> None:\n    import top\n")
    (tmp_path / "top.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mid import f\nimport low\n"
    )
    graph = import_graph({n: tmp_path / f"{n}.py" for n in ("low", "mid", "top")})
    assert graph == {"low": set(), "mid": {"top"}, "top": {"mid", "low"}}
    assert find_cycles(graph) == [["mid", "top"]]


def test_every_package_has_a_layer() -> None:
    assert sorted(p for layer in LAYERS for p in layer) == sorted(PACKAGES)


def test_no_import_goes_up_the_layers() -> None:
    """An app embedding the edge SDK must not pull in the verifier, the model code runs on both
    sides, and the training and the benches sit on top (docs/architecture.md §1)."""
    graph = import_graph(project_modules())
    assert layer_violations(graph) == []
    # the torch drafter runs the model code from shared
    assert "shared.model.llama" in reaches(graph, "edge_client.drafters.torch_drafter")
