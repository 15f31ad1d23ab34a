"""Layering: kvjax is a stack of layers, and no module refers to a layer above its own.

* The layer table (``LAYERS``, bottom to top; ``docs/architecture.md`` shows it) puts every module
  in one layer. No edge of any of the five kinds the import graph records
  (``tests/import_graph.py``: module-level, function-local, TYPE_CHECKING, lazy re-export and
  hook strings) goes from a lower layer to a higher one, except the named ``ALLOWED_UPWARD``
  ones. Within a layer any direction is allowed, but module-level imports form no cycle.
* Importing a package loads only modules of its layer and below, and neither jax nor the Pallas
  kernels (``LIGHT_IMPORTS``); no module of the layers up to host loads jax, nor does any of
  ``JAX_FREE_MODULES`` (the public packages, the CLI's jax-free commands) or
  ``python -m kvjax plan``.

Each import check runs in a fresh interpreter (a subprocess), since this test process has jax
loaded already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_graph import EDGE_KINDS, Edge, ImportGraph, find_cycles, read_edges, read_package

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("jax", "jaxlib", "pallas_kernels", "flax")

# --- the layer table ----------------------------------------------------------------------------

#: The layers, bottom to top: a module may refer to modules of its own layer and the layers below.
#: Each entry names a module and, by prefix, its submodules; the longest entry that names a module
#: decides its layer (``kvjax.transfers.transfer`` is device although ``kvjax.tiers`` is host). The
#: root package ``kvjax`` names only its own ``__init__``.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "core",
        [
            "kvjax.errors",
            "kvjax.lazy",
            "kvjax.version",
            "kvjax.protocols",
            "kvjax.request",
            "kvjax.config",
            "kvjax.chips",
            "kvjax.layer_kinds",
            "kvjax.mesh_check",
            "kvjax.transfer_status",
            "kvjax.page_hash",
            "kvjax.multihost",  # the channel, the process group, the agreement
        ],
    ),
    ("model", ["kvjax.hf", "kvjax.spec", "kvjax.hf_config", "kvjax.presets", "kvjax.gguf", "kvjax.text"]),
    ("records", ["kvjax.kinds", "kvjax.layout"]),
    ("plan", ["kvjax.plan", "kvjax.pipeline_check"]),
    (
        "host",
        # kv_events: the wire format of the trees' events (msgspec, pyzmq: imported when used);
        # multimodal: items' content hashes, the encoder-output cache, pad values
        [
            "kvjax.alloc",
            "kvjax.req_pool",
            "kvjax.hybrid_req_pool",
            "kvjax.radix",
            "kvjax.tiers",
            "kvjax.kv_events",
            "kvjax.multimodal",
        ],
    ),
    ("device", ["kvjax.pools", "kvjax.device_updates", "kvjax.device_state", "kvjax.attention", "kvjax.transfers"]),
    ("build", ["kvjax.build"]),
    # replay: trees + the DP router, host-only; disaggregation: prefill and decode servers
    ("serving", ["kvjax.serve", "kvjax.dp", "kvjax.replay", "kvjax.disaggregation"]),
    ("app", ["kvjax", "kvjax.__main__", "kvjax.cli", "kvjax.demo", "kvjax.demo_config"]),
]
LAYER_NAMES = [name for name, _ in LAYERS]
ROOT_PACKAGE = "kvjax"

#: Upward edges allowed for now, (module, target) -> why. Keep it empty: an upward need becomes a
#: hook registered from above or a Protocol below.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _names(entry: str, module: str) -> bool:
    """Whether layer-table ``entry`` names ``module``: the module itself or a submodule of it
    (the root package's entry names only the root package)."""
    if entry == ROOT_PACKAGE:
        return module == ROOT_PACKAGE
    return module == entry or module.startswith(entry + ".")


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of ``module``'s layer (its longest naming entry); None if none names it."""
    naming = [
        (len(entry), index) for index, (_, entries) in enumerate(LAYERS) for entry in entries if _names(entry, module)
    ]
    return max(naming)[1] if naming else None


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return read_package(ROOT)


# --- the reader -----------------------------------------------------------------------------------

_SYNTHETIC_MODULES = {
    "kvjax",
    "kvjax.pkg",
    "kvjax.pkg.mod",
    "kvjax.pkg.sibling",
    "kvjax.other",
    "kvjax.low",
    "kvjax.low.sub",
    "kvjax.tried",
    "kvjax.fallback",
    "kvjax.runtime",
    "kvjax.typed",
    "kvjax.typed_too",
    "kvjax.in_class",
    "kvjax.in_method",
    "kvjax.local",
    "kvjax.never_runs",
    "kvjax.lazy_target",
    "kvjax.hooked",
}

_SYNTHETIC_SOURCE = '''
"""kvjax.lazy_target is named in prose here: not an edge."""
from __future__ import annotations

import typing
from typing import TYPE_CHECKING

import numpy
import kvjax.low.sub.not_a_module
from kvjax.low import sub, sub
from kvjax.low import some_name
from . import sibling
from .sibling import name
from .. import other

try:
    import kvjax.tried
except ImportError:
    import kvjax.fallback

if TYPE_CHECKING:
    from kvjax.typed import T

    def never_called():
        import kvjax.never_runs
else:
    import kvjax.runtime
if typing.TYPE_CHECKING:
    import kvjax.typed_too


class Holder:
    import kvjax.in_class

    def method(self):
        import kvjax.in_method


def function():
    from kvjax.local import thing

    return thing


_LAZY = {"Name": "kvjax.lazy_target"}
HOOK = "kvjax.hooked.not_a_module:attribute"
ITSELF = "kvjax.pkg.mod"
'''


def test_reader_finds_each_edge_kind_and_resolves_each_import_form():
    edges = read_edges(_SYNTHETIC_SOURCE, "kvjax.pkg.mod", _SYNTHETIC_MODULES)
    assert {(e.target, e.kind) for e in edges} == {
        ("kvjax.low.sub", "module"),  # import of a non-module trimmed; from-import of a submodule
        ("kvjax.low", "module"),  # from-import of a name
        ("kvjax.pkg.sibling", "module"),  # relative, both forms
        ("kvjax.other", "module"),  # two levels up
        ("kvjax.tried", "module"),
        ("kvjax.fallback", "module"),
        ("kvjax.runtime", "module"),  # the else of TYPE_CHECKING runs
        ("kvjax.in_class", "module"),  # a class body runs at import
        ("kvjax.typed", "type_checking"),
        ("kvjax.typed_too", "type_checking"),
        ("kvjax.never_runs", "type_checking"),
        ("kvjax.in_method", "local"),
        ("kvjax.local", "local"),
        ("kvjax.lazy_target", "lazy"),
        ("kvjax.hooked", "hook"),
    }
    assert {e.kind for e in edges} == set(EDGE_KINDS)
    assert len(edges) == len(set(edges)), "each edge once"
    hook_line = _SYNTHETIC_SOURCE.splitlines().index('HOOK = "kvjax.hooked.not_a_module:attribute"') + 1
    assert str(next(e for e in edges if e.kind == "hook")) == f"kvjax.pkg.mod:{hook_line} -> kvjax.hooked [hook]"


def test_reader_resolves_relative_imports_of_a_package_init():
    modules = {"kvjax", "kvjax.pkg", "kvjax.pkg.mod", "kvjax.other"}
    edges = read_edges("from . import mod\nfrom .. import other\n", "kvjax.pkg", modules, is_package=True)
    assert [(e.target, e.kind) for e in edges] == [("kvjax.pkg.mod", "module"), ("kvjax.other", "module")]


def test_the_whole_graph_was_read(graph):
    assert len(graph.modules) > 100
    assert len(graph.all_edges()) > len(graph.modules)
    assert {"module", "local", "type_checking", "lazy"} <= {e.kind for e in graph.all_edges()}


# --- the layers -----------------------------------------------------------------------------------


def test_layer_table_entries_name_modules(graph):
    stale = [entry for _, entries in LAYERS for entry in entries if not any(_names(entry, m) for m in graph.modules)]
    assert not stale, f"layer table entries naming no module: {stale}"
    entries = [entry for _, entries in LAYERS for entry in entries]
    assert len(entries) == len(set(entries)), "an entry in two layers"


def test_every_module_has_a_layer(graph):
    unplaced = sorted(m for m in graph.modules if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add each to its layer in LAYERS): {unplaced}"


def _upward_edges(graph: ImportGraph) -> list[tuple[Edge, int, int]]:
    """Each edge from a lower layer to a higher one, with the two layers (modules in no layer are
    reported by ``test_every_module_has_a_layer``)."""
    upward = []
    for edge in sorted(graph.all_edges()):
        source, target = layer_of(edge.source), layer_of(edge.target)
        if source is not None and target is not None and target > source:
            upward.append((edge, source, target))
    return upward


def test_no_edge_goes_up_a_layer(graph):
    lines = [
        f"{edge}  ({LAYER_NAMES[source]} -> {LAYER_NAMES[target]})"
        for edge, source, target in _upward_edges(graph)
        if (edge.source, edge.target) not in ALLOWED_UPWARD
    ]
    assert not lines, f"{len(lines)} edges from a lower layer to a higher one:\n" + "\n".join(lines)


def test_allowed_upward_edges_still_exist(graph):
    present = {(edge.source, edge.target) for edge, _, _ in _upward_edges(graph)}
    stale = sorted(set(ALLOWED_UPWARD) - present)
    assert not stale, f"ALLOWED_UPWARD entries with no upward edge left (remove them): {stale}"


def test_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_module_level_import_cycles(graph):
    cycles = find_cycles(graph.targets(["module"]))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# --- light imports (subprocesses) -----------------------------------------------------------------


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False
    )


def _modules_loaded_by(statement: str) -> tuple[list[str], list[str]]:
    """The kvjax modules and the heavy modules (``HEAVY``) in ``sys.modules`` after running
    ``statement`` in a fresh interpreter."""
    code = (
        f"import json, sys\n{statement}\n"
        f"print(json.dumps([sorted(m for m in sys.modules if m == 'kvjax' or m.startswith('kvjax.')),"
        f" sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    kvjax_modules, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    return kvjax_modules, heavy


#: Package -> the highest layer importing it may load. The root package's ``__init__`` runs before
#: every submodule's, so it loads core modules only.
LIGHT_IMPORTS = {"kvjax": "core", "kvjax.plan": "plan", "kvjax.alloc": "host", "kvjax.radix": "host"}


@pytest.mark.parametrize("package", sorted(LIGHT_IMPORTS))
def test_import_loads_only_its_layer_and_below(package):
    """A package above a loaded module is allowed whatever its layer (Python runs it on the way;
    ``kvjax``'s ``__init__`` and ``kvjax.multihost``'s import nothing above core); every module
    it imports is checked like any other."""
    ceiling = LAYER_NAMES.index(LIGHT_IMPORTS[package])
    assert package == "kvjax" or layer_of(package) == ceiling
    loaded, heavy = _modules_loaded_by(f"import {package}")
    ancestors = {m.rpartition(".")[0] for m in loaded} | {ROOT_PACKAGE}
    above = [
        f"{m} ({LAYER_NAMES[layer]})"
        for m in loaded
        if m not in ancestors and (layer := layer_of(m)) is not None and layer > ceiling
    ]
    assert not above, f"import {package} loads modules above the {LIGHT_IMPORTS[package]} layer: {above}"
    assert heavy == [], f"import {package} loads {heavy}"


# --- jax-free imports (subprocesses) --------------------------------------------------------------


def test_host_layers_import_neither_jax_nor_the_kernels(graph):
    """Every module of the layers up to host (core to host), imported in one interpreter."""
    host = LAYER_NAMES.index("host")
    modules = sorted(m for m in graph.modules if (layer := layer_of(m)) is not None and layer <= host)
    assert len(modules) > 50
    statement = f"import importlib\nfor name in {modules!r}:\n    importlib.import_module(name)"
    assert _modules_loaded_by(statement)[1] == []


JAX_FREE_MODULES = [
    "kvjax",
    "kvjax.plan",
    "kvjax.spec",
    "kvjax.config",
    "kvjax.alloc",
    "kvjax.radix",
    "kvjax.protocols",
    "kvjax.kinds",
    "kvjax.layout",
    "kvjax.pools",
    "kvjax.req_pool",
    "kvjax.tiers",
    "kvjax.kv_events",
    "kvjax.multimodal",
    "kvjax.cli",
    "kvjax.cli.demo_command",
    "kvjax.cli.generate_command",
    "kvjax.replay",
    "kvjax.cli.replay_command",
    "kvjax.demo_config",
    "kvjax.pipeline_check",
]


@pytest.mark.parametrize("module", JAX_FREE_MODULES)
def test_module_imports_neither_jax_nor_the_kernels(module):
    assert _modules_loaded_by(f"import {module}")[1] == []


def test_import_kvjax_keeps_the_public_names_reachable_lazily():
    code = (
        "import sys, kvjax\n"
        "assert 'jax' not in sys.modules and 'kvjax.plan' not in sys.modules\n"
        "from kvjax import CacheConfig, ModelSpec, plan_kv_cache\n"
        "assert CacheConfig.__module__ == 'kvjax.config' and 'jax' not in sys.modules\n"
        "assert callable(kvjax.build_kv_cache) and kvjax.KVCache.__name__ == 'KVCache'\n"
        "assert 'jax' in sys.modules\n"
        "assert set(kvjax.__all__) <= set(dir(kvjax)) and all(getattr(kvjax, n) for n in kvjax.__all__)\n"
        "assert kvjax.__version__\n"
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
    loaded = _modules_loaded_by(statement)[1]
    assert loaded == [], f"python -m kvjax plan imports {loaded}"
