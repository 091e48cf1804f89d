"""The package layout is the architecture: layers that import only downward, no import circles, few loose modules.

Imports are read from the sources (``ast``, relative imports resolved), never by importing a module, and every
one counts: at module level, inside functions (the lazy ones) and under ``TYPE_CHECKING`` (a type-only import is
still a dependency, and the circle it hides comes back the day the annotation is evaluated). ``from pkg import
name`` is an edge to the submodule ``pkg.name`` when there is one, else to ``pkg`` itself (its ``__init__``).
docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lib" / "sparsedraft"

# Bottom to top, by the first name under ``sparsedraft``. A module may import from its own layer and those below.
# Peers in one layer may import each other's modules one way only (no circle between packages, checked below).
LAYERS: list[set[str]] = [
    {"errors", "progress", "cliopts", "report"},  # shared leaves: anyone imports them, they import only each other
    {"engine"},  # config, weights, model, the cache protocol, kernels, the one prefill, plain decoding, costs
    {"caches"},  # the sparse KV caches over the engine's cache protocol
    {"speculative"},  # verification, drafters, drivers, trained-drafter loading, decode() and its methods
    {"budgetdraft", "analysis"},  # training drafters; the analyses behind the notebooks
    {"bench", "runner"},  # benchmarks and records; the notebook runner
    {"__main__", ""},  # the CLI, and "" the package's own __init__ (the front door re-exports from every layer)
]
# (importer, imported) modules allowed to point upward, each with the reason it cannot point down yet. Empty: every
# edge points down; an entry here is a debt, and the test fails once the edge is gone so the entry goes too.
ALLOWED_UPWARD: set[tuple[str, str]] = set()
MAX_LOOSE_MODULES = 8  # .py files directly in sparsedraft/, __init__ and __main__ included


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package at ``root`` (a package by its
    ``__init__`` name: ``sparsedraft.caches``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_edges(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """Each module's imports of other modules of the package, and the imports that name no module of it."""
    files = module_files(root)
    package = root.name
    edges: dict[str, set[str]] = {name: set() for name in files}
    unresolved = []
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]  # the importing package
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target != package and not target.startswith(package + "."):
                    continue
                if target in files:
                    edges[name].add(target)
                else:
                    unresolved.append(f"{name}:{node.lineno} imports {target}, which is no module of {package}")
    return edges, unresolved


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, members in enumerate(LAYERS):
        if top in members:
            return rank
    raise KeyError(f"{module} belongs to no layer: add {top!r} to LAYERS in tests/test_layout.py (and to "
                   "docs/architecture.md)")


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: its strongly connected components of more than one node (or a node that
    imports itself), each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def upward(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Edges from a module to one in a higher layer."""
    return {(a, b) for a, targets in edges.items() for b in targets if layer(b) > layer(a)}


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between top-level packages (and loose modules): what peers of one layer must not close a circle
    in, though no two modules do."""
    def top(module: str) -> str:
        return module.split(".")[1] if "." in module else ""
    collapsed: dict[str, set[str]] = {}
    for a, targets in edges.items():
        collapsed.setdefault(top(a), set()).update(top(b) for b in targets if top(b) != top(a))
    return collapsed


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    edges, unresolved = import_edges(ROOT)
    assert not unresolved, "\n".join(unresolved)
    return edges


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer(module)


def test_no_import_circles(graph):
    found = circles(graph)
    assert not found, "import circles (break each by moving what both sides need below them):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_no_circle_between_packages(graph):
    found = circles(package_edges(graph))
    assert not found, f"packages importing each other: {found}"


def test_no_module_imports_from_a_layer_above(graph):
    found = upward(graph)
    assert found <= ALLOWED_UPWARD, "upward imports (move the shared part down, or invert the call):\n" + "\n".join(
        f"{a} -> {b}" for a, b in sorted(found - ALLOWED_UPWARD))
    assert ALLOWED_UPWARD <= found, f"ALLOWED_UPWARD lists edges that are gone; drop {ALLOWED_UPWARD - found}"


def test_few_loose_modules_at_the_package_top():
    loose = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} loose modules in sparsedraft/: {loose}; each belongs in " \
                                            "the package of its layer"


def test_the_checks_find_a_circle_an_upward_edge_and_a_lazy_import(tmp_path):
    """On a made-up package: an import inside a function, a relative one two levels up and a ``TYPE_CHECKING``
    one all count, and the circle and the upward edge they make are found."""
    root = tmp_path / "sparsedraft"
    for folder in (root, root / "engine", root / "caches"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (root / "errors.py").write_text("")
    (root / "engine" / "model.py").write_text(
        "from ..errors import require\n\n\ndef build():\n    from ..caches.ring import Ring\n")
    (root / "caches" / "ring.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..engine import model\n")
    (root / "engine" / "stale.py").write_text("from .gone import thing\n")
    edges, unresolved = import_edges(root)
    assert edges["sparsedraft.engine.model"] == {"sparsedraft.errors", "sparsedraft.caches.ring"}
    assert edges["sparsedraft.caches.ring"] == {"sparsedraft.engine.model"}
    assert unresolved == ["sparsedraft.engine.stale:1 imports sparsedraft.engine.gone, which is no module of "
                          "sparsedraft"]
    assert circles(edges) == [["sparsedraft.caches.ring", "sparsedraft.engine.model"]]
    assert upward(edges) == {("sparsedraft.engine.model", "sparsedraft.caches.ring")}
    assert circles(package_edges(edges)) == [["caches", "engine"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
