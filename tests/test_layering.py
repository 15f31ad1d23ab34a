"""Layering: the host-side layers import neither jax nor the Pallas kernels, and kvjax has no
import cycles.

Each import check runs in a fresh interpreter (a subprocess), since this test process has jax
loaded already.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvjax"
HEAVY = ("jax", "jaxlib", "pallas_kernels", "flax")

JAX_FREE_MODULES = [
    "kvjax",
    "kvjax.plan",
    "kvjax.spec",
    "kvjax.config",
    "kvjax.alloc",
    "kvjax.radix",
    "kvjax.protocols",
    "kvjax.pools.registry",
    "kvjax.req_pool",
    "kvjax.tiers",
    "kvjax.cli",
    "kvjax.cli.demo_command",
    "kvjax.cli.generate_command",
    "kvjax.demo_config",
    "kvjax.pipeline_check",
]


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False
    )


def _loaded_heavy_modules_after(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    out = _run(code)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", JAX_FREE_MODULES)
def test_module_imports_neither_jax_nor_the_kernels(module):
    assert _loaded_heavy_modules_after(f"import {module}") == []


def test_import_kvjax_keeps_the_jax_names_reachable_lazily():
    code = (
        "import sys, kvjax\n"
        "assert 'jax' not in sys.modules\n"
        "assert callable(kvjax.build_kv_cache) and kvjax.KVCache.__name__ == 'KVCache'\n"
        "assert 'jax' in sys.modules\n"
        "assert set(kvjax.__all__) <= set(dir(kvjax))\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr


def test_plan_command_imports_neither_jax_nor_the_kernels():
    """``python -m kvjax plan --model tiny --memory 1GiB --json``, run as ``-m`` runs it."""
    statement = (
        "import contextlib, io, runpy\n"
        "sys.argv = ['kvjax', 'plan', '--model', 'tiny', '--memory', '1GiB', '--json']\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n"
        "        runpy.run_module('kvjax', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
        "assert json.loads(buf.getvalue())['max_total_tokens'] > 0"
    )
    loaded = _loaded_heavy_modules_after(statement)
    assert loaded == [], f"python -m kvjax plan imports {loaded}"


# --- no import cycles ------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module, modules: set[str], package: str) -> set[str]:
    """kvjax modules imported when this module is imported (module level, TYPE_CHECKING excluded)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return {m for m in found if m in modules}


def _find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first walk, as the cycle it closes."""
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


def test_cycle_finder_finds_a_cycle():
    assert _find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _find_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycles():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p): p for p in paths}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _top_level_imports(ast.parse(path.read_text()), set(modules), package) - {name}
    assert sum(map(len, graph.values())) > len(graph), "the import graph was read"
    cycles = _find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
