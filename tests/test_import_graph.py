"""The package's import graph has no cycle.

Every ``import`` and ``from ... import`` in ``vllm_semmoe`` and ``csrc_triton`` counts, those inside
functions too: a function-local import that closes a cycle hides the cycle from Python's import
system but not from a reader, who still cannot understand one module without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm_semmoe", "csrc_triton")


def package_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported(module: str, node: ast.AST, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The project modules one import statement of ``module`` names (the nearest enclosing
    module for a name that is not itself a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            if not is_package:
                parts.pop()
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{alias.name}" for alias in node.names]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source."""
    modules = package_modules()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets.update(_imported(module, node, path.name == "__init__.py", modules))
        graph[module] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted. A package
    counts as importing what its ``__init__`` imports: importing ``policy`` runs ``policy.semmoe``."""
    edges = graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def test_finder_sees_a_cycle() -> None:
    """The finder itself: planted cycles of two and three modules are found, a chain is not."""
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a"}, "q": {"r"}, "r": {"s"}, "s": {"q"}, "t": set()}
    assert sorted(find_cycles(graph)) == [["p.a", "p.b"], ["q", "r", "s"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_graph_reads_relative_and_local_imports() -> None:
    graph = import_graph()
    assert "vllm_semmoe.core.trace" in graph["vllm_semmoe.evaluation.evaluate"]  # a module-level relative import
    assert graph["vllm_semmoe.cli"], "the CLI imports its command modules"


def test_import_graph_has_no_cycle() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (each line one cycle's modules): " + "; ".join(" <-> ".join(c) for c in cycles)


#: the packages from the ground up: each imports only those before it (and itself)
LAYERS = ("csrc_triton", "vllm_semmoe.core", "vllm_semmoe.kernels", "vllm_semmoe.evaluation",
          "vllm_semmoe.vllm_adapter", "vllm_semmoe.tools", "vllm_semmoe.testing", "vllm_semmoe.cli")
GROUND = ("vllm_semmoe", "vllm_semmoe.assets")  # the version and the packaged model: anyone may import them


def layer_of(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import of a module from a later layer than the importer's."""
    found = []
    for module, targets in graph.items():
        here = layer_of(module)
        for target in targets:
            there = layer_of(target)
            if target not in GROUND and (here is None or there is None or there > here):
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_layer_check_sees_an_upward_import() -> None:
    graph = {"vllm_semmoe.core.trace": {"vllm_semmoe.evaluation.evaluate", "vllm_semmoe"},
             "vllm_semmoe.tools.engine": {"vllm_semmoe.vllm_adapter.config"}}
    assert upward_imports(graph) == ["vllm_semmoe.core.trace -> vllm_semmoe.evaluation.evaluate"]


def test_packages_import_only_the_layers_below() -> None:
    graph = {m: t for m, t in import_graph().items() if m not in GROUND}
    upward = upward_imports(graph)
    assert not upward, "imports against the package layers " + " < ".join(LAYERS) + ": " + "; ".join(upward)
