"""``kvjax.radix`` stays host-only: none of its modules imports jax, the Pallas kernels or a layer
above the host layer (pools, attention, build, serving) at run time, so it cannot pull them in
indirectly. It may import the planner (jax-free, a layer below: the tree's options and the cache
kinds' tree components are the plan's). ``tests/test_layering.py`` checks every layer and the
package import in a subprocess."""

from __future__ import annotations

import ast
import pathlib

import kvjax.radix

FORBIDDEN = (
    "jax",
    "jaxlib",
    "pallas_kernels",
    "flax",
    "kvjax.pools",
    "kvjax.attention",
    "kvjax.build",
    "kvjax.serve",
    "kvjax.dp",
)


def _runtime_imports(tree: ast.Module) -> list[str]:
    """Modules imported outside ``if TYPE_CHECKING:`` blocks."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import):
                out.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                out.append(child.module)
            visit(child)

    visit(tree)
    return out


def test_no_radix_module_imports_jax_or_a_layer_above_at_run_time():
    folder = pathlib.Path(kvjax.radix.__file__).parent
    files = sorted(folder.rglob("*.py"))
    assert len(files) >= 10
    bad = {}
    for path in files:
        mods = _runtime_imports(ast.parse(path.read_text()))
        hits = [m for m in mods if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
        if hits:
            bad[path.relative_to(folder).as_posix()] = hits
    assert not bad, f"run-time imports that pull in jax or a layer above: {bad}"
