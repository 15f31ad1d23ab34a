"""The kvjax import graph, read from the source with ``ast`` (nothing is imported).

Every edge from one kvjax module to another is recorded with its line and one of five kinds:

* ``module``: an import statement that runs when the module is imported: at module level,
  including inside module-level ``try``, ``if``, ``with`` and class bodies;
* ``local``: an import statement inside a function body (runs when the function is called);
* ``type_checking``: an import under ``if TYPE_CHECKING:`` (read by type checkers only);
* ``lazy``: a string constant that is exactly a kvjax module path, ``"kvjax.build"`` (the
  ``_LAZY`` re-export tables of the packages, ``importlib.import_module`` arguments);
* ``hook``: a string constant ``"kvjax.some.module:attribute"`` (a hook resolved by name).

Resolution: ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import c`` to ``a.b.c`` when that
is a module, else to ``a.b``; relative imports resolve against the importing module's package. A
target that is not a module is trimmed to its longest module prefix. The package ``__init__`` s
Python runs on the way to a target are not edges of their own. An edge from a module to itself is
dropped; a string naming no kvjax module is not an edge.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

EdgeKind = Literal["module", "local", "type_checking", "lazy", "hook"]
EDGE_KINDS: tuple[EdgeKind, ...] = ("module", "local", "type_checking", "lazy", "hook")

PACKAGE = "kvjax"
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE_PATH = re.compile(rf"^{PACKAGE}(?:\.{_NAME})+$")
_HOOK = re.compile(rf"^({PACKAGE}(?:\.{_NAME})+):{_NAME}$")


@dataclass(frozen=True, order=True)
class Edge:
    """``source`` (a module) refers to ``target`` (another module) at ``line``, as ``kind``."""

    source: str
    line: int
    target: str
    kind: EdgeKind

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target} [{self.kind}]"


@dataclass(frozen=True)
class ImportGraph:
    """``modules``: every module of the package, by dotted name, and its file; ``edges``: each
    module's edges, in source order (a module with none has an empty list)."""

    modules: Mapping[str, Path]
    edges: Mapping[str, list[Edge]]

    def all_edges(self) -> list[Edge]:
        return [edge for edges in self.edges.values() for edge in edges]

    def targets(self, kinds: Iterable[EdgeKind]) -> dict[str, set[str]]:
        """Each module's set of targets over edges of ``kinds``."""
        wanted = set(kinds)
        return {name: {e.target for e in edges if e.kind in wanted} for name, edges in self.edges.items()}


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path`` (a package's ``__init__.py`` names the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def longest_module_prefix(name: str, modules: set[str]) -> str | None:
    """The longest dotted prefix of ``name`` (``name`` itself included) that is in ``modules``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _EdgeReader(ast.NodeVisitor):
    """Walks one module's tree, keeping the kind an import found here would have."""

    def __init__(self, name: str, is_package: bool, modules: set[str]) -> None:
        self.name = name
        self.package = name if is_package else name.rpartition(".")[0]
        self.modules = modules
        self.kind: EdgeKind = "module"
        self.edges: list[Edge] = []

    def _add(self, target: str | None, kind: EdgeKind, line: int) -> None:
        if target is not None and target != self.name:
            self.edges.append(Edge(self.name, line, target, kind))

    def _under(self, kind: EdgeKind, nodes: Iterable[ast.AST]) -> None:
        outer, self.kind = self.kind, kind
        for node in nodes:
            self.visit(node)
        self.kind = outer

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._under("type_checking", node.body)
        for statement in node.orelse:
            self.visit(statement)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # Decorators, defaults and annotations run where the function is defined; the body
        # runs when it is called. A function under TYPE_CHECKING never runs: its imports stay
        # type_checking. (A lambda holds no statement, so no import.)
        body_ids = {id(statement) for statement in node.body}
        for child in ast.iter_child_nodes(node):
            if id(child) not in body_ids:
                self.visit(child)
        self._under("type_checking" if self.kind == "type_checking" else "local", node.body)

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(longest_module_prefix(alias.name, self.modules), self.kind, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.package.split(".")
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            target = submodule if submodule in self.modules else longest_module_prefix(base, self.modules)
            self._add(target, self.kind, node.lineno)

    def visit_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str):
            return
        hook = _HOOK.match(node.value)
        if hook:
            self._add(longest_module_prefix(hook.group(1), self.modules), "hook", node.lineno)
        elif _MODULE_PATH.match(node.value):
            self._add(longest_module_prefix(node.value, self.modules), "lazy", node.lineno)


def read_edges(source: str, name: str, modules: set[str], *, is_package: bool = False) -> list[Edge]:
    """The edges of module ``name`` (its text ``source``; ``is_package``: it is a package's
    ``__init__``) to the modules of ``modules``, in source order, each edge once (``from m import
    a, b`` is one edge)."""
    reader = _EdgeReader(name, is_package, modules)
    reader.visit(ast.parse(source))
    return sorted(set(reader.edges), key=lambda e: (e.line, e.target, e.kind))


def read_package(root: Path, package: str = PACKAGE) -> ImportGraph:
    """The import graph of every module of ``root / package``."""
    paths = sorted((root / package).rglob("*.py"))
    modules = {module_name(path, root): path for path in paths}
    names = set(modules)
    edges = {
        name: read_edges(path.read_text(), name, names, is_package=path.name == "__init__.py")
        for name, path in modules.items()
    }
    return ImportGraph(modules, edges)


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every back edge of a depth-first walk (in name order), as the cycle it closes
    (``[a, b, c, a]``); empty exactly when ``graph`` has no cycle."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    return cycles
