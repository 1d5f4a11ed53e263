"""The import rules of DESIGN.md ("Boundaries (who may import whom)"), checked on the code.

The folder rules and the cycle check read kdaserve's import graph from the source with `ast`
(nothing is imported); the torch-free rule imports the scheduler and cache/ in a child process
where importing torch or numpy fails.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kdaserve"

# Import edges left out of the cycle check, each with the issue that removes it.
KNOWN_EDGES: set[tuple[str, str]] = set()    # none: every cycle is gone

# server/ modules that may import a kdaserve.model module, each with its reason; otherwise the
# server reaches the model only through the engine.
SERVER_MODEL_IMPORTS: dict[tuple[str, str], str] = {
    ("kdaserve.server.cli", "kdaserve.model.registry"):
        "reads config.json to refuse a bad model before the engine process starts; the "
        "registry imports no model class until one is built",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str          # a kdaserve module, or an outside top-level name ("torch")
    module_level: bool   # runs when the source is imported (not inside a function)
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = name if is_package else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}" if base else pkg
        # `from pkg import sub` imports the submodule; `from mod import name` the module
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                 for a in node.names]
    return [n if n.startswith("kdaserve") else n.split(".")[0] for n in names]


def _imports(tree: ast.Module):
    """(import node, module level, under TYPE_CHECKING) for every import in the tree."""
    def visit(nodes: list[ast.stmt], module_level: bool, type_checking: bool):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, module_level, type_checking
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from visit(node.body, module_level, True)
                yield from visit(node.orelse, module_level, type_checking)
            else:
                # a class body runs at import; a function body only when called
                inner = module_level and not isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef))
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        yield from visit([child], inner, type_checking)
                    elif isinstance(child, ast.excepthandler):
                        yield from visit(child.body, inner, type_checking)
    yield from visit(tree.body, True, False)


def import_graph() -> list[Edge]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    edges = []
    for name, path in sorted(paths.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node, module_level, type_checking in _imports(tree):
            for target in _targets(name, path.name == "__init__.py", node, modules):
                if target != name:
                    edges.append(Edge(name, target, module_level, type_checking))
    return edges


GRAPH = import_graph()


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(sources: str, targets: tuple[str, ...]) -> list[str]:
    return sorted({f"{e.source} -> {e.target}" for e in GRAPH if not e.type_checking
                   and _under(e.source, sources) and any(_under(e.target, t) for t in targets)})


def test_the_graph_sees_imports_of_every_kind():
    # the rules below are only as good as the graph: relative, function-level and
    # TYPE_CHECKING imports must all be in it
    edges = {(e.source, e.target): e for e in GRAPH}
    assert len({e.source for e in GRAPH}) > 100
    assert edges[("kdaserve.engine.scheduler", "kdaserve.cache.manager")].module_level
    assert not edges[("kdaserve.engine.executor.worker",
                      "kdaserve.engine.runner_builder")].module_level
    assert ("kdaserve.engine.runner", "torch") in edges


@pytest.mark.parametrize("package, forbidden", [
    ("kdaserve.cache", ("kdaserve.model", "kdaserve.ops", "torch", "numpy")),
    ("kdaserve.engine.scheduler", ("torch", "numpy")),
    ("kdaserve.model", ("kdaserve.engine", "kdaserve.server")),
    ("kdaserve.ops", ("kdaserve.model",)),
    # disagg/ and distributed/ move bytes and run collectives: no scheduling policy
    ("kdaserve.distributed", ("kdaserve.engine.scheduler",)),
    ("kdaserve.disagg", ("kdaserve.engine.scheduler",)),
])
def test_folder_rules(package, forbidden):
    assert _violations(package, forbidden) == []


def test_server_reaches_the_model_only_through_the_engine():
    found = set(_violations("kdaserve.server", ("kdaserve.model",)))
    allowed = {f"{s} -> {t}" for s, t in SERVER_MODEL_IMPORTS}
    assert found - allowed == set()


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _describe(cycles: list[list[str]], edges: list[Edge]) -> str:
    lines = []
    for c in cycles:
        inside = sorted({(e.source, e.target, e.module_level) for e in edges
                         if e.source in c and e.target in c})
        lines.append("cycle: " + ", ".join(c))
        lines += [f"  {s} -> {t}{'' if top else ' (in a function)'}" for s, t, top in inside]
    return "\n".join(lines)


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "all"])
def test_no_import_cycles(module_level_only):
    edges = [e for e in GRAPH if e.target.startswith("kdaserve") and not e.type_checking
             and (e.module_level or not module_level_only)
             and (e.source, e.target) not in KNOWN_EDGES]
    cycles = _cycles(edges)
    assert not cycles, _describe(cycles, edges)


def test_the_cycle_check_finds_a_cycle():
    edges = [Edge("a", "b", True, False), Edge("b", "c", False, False),
             Edge("c", "a", True, False), Edge("c", "d", True, False)]
    assert _cycles(edges) == [["a", "b", "c"]]


_NO_TORCH = """
import importlib, importlib.abc, pkgutil, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} imported")

sys.meta_path.insert(0, NoTorch())
import kdaserve.cache
names = ["kdaserve.engine.scheduler"] + [
    f"kdaserve.cache.{m.name}" for m in pkgutil.iter_modules(kdaserve.cache.__path__)]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_scheduler_and_cache_import_without_torch():
    # a child process: this one has torch imported already
    root = str(PACKAGE.parent)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_NO_TORCH)], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout) >= 10     # every cache/ module was imported
