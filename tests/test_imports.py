"""The import graph of the package: no circle among its modules, function-level imports included.

Every ``import`` and ``from ... import`` statement of ``hf_mhc`` (with ``hf_mhc.kernels`` from ``kernels/``,
``hf_mhc.conversion`` from ``conversion/`` and the ``hf_mhc.diagnostics`` package) counts, wherever it stands: at the
top, inside a function or under ``try``, so that a late import cannot hide a circle. Importing ``a.b.c`` also imports
the packages ``a.b`` and ``a`` first, so it counts as an import of each of them that does not contain the importer.
Only ``if TYPE_CHECKING:`` blocks, which never run, are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hf_mhc": "hf_mhc", "hf_mhc.diagnostics": "hf_mhc/diagnostics", "hf_mhc.kernels": "kernels",
            "hf_mhc.conversion": "conversion"}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _statements(tree: ast.AST):
    """The import statements of ``tree``, anywhere but under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (statement for child in node.orelse for statement in _statements(child))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _statements(node)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: dict) -> list[str]:
    """The project modules ``node`` (a statement of ``module``) imports by name."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            parts = (module if is_package else module.rpartition(".")[0]).split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported project module: line of the first such import}}``."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {module: {} for module in modules}
    for module, path in modules.items():
        containing = {module.rsplit(".", depth)[0] for depth in range(module.count(".") + 1)}
        for node in _statements(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _targets(module, path.stem == "__init__", node, modules):
                parts = target.split(".")
                for end in range(1, len(parts) + 1):  # the packages above the target are imported first
                    imported = ".".join(parts[:end])
                    if imported in modules and imported not in containing:
                        graph[module].setdefault(imported, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 30 and "hf_mhc.diagnostics.cli" in graph and "hf_mhc.kernels.functional" in graph
    report = [" -> ".join(component) + ": " + ", ".join(
        f"{source} imports {target} (line {line})" for source in component
        for target, line in graph[source].items() if target in component) for component in circles(graph)]
    assert not report, "\n".join(report)


def test_the_graph_sees_late_imports_and_parent_packages():
    """The checker itself: a function-level import and the package a submodule import runs both count."""
    graph = import_graph()
    assert "hf_mhc.diagnostics.cli" in graph["hf_mhc.cli"]  # imported inside _setup_inspect
    assert "hf_mhc.kernels" in graph["hf_mhc.monkey_patch"]  # from .kernels.functional import ...
    assert "hf_mhc.kernels.triton_backend" in graph["hf_mhc.kernels.dispatch"]  # inside load_op_set
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]

