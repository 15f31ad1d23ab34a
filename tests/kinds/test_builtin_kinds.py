"""The built-in cache kinds: each is registered in every layer, found for the plans that use it,
decides what it owns, and the shared build, planning and serving modules name none of them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.attention.kinds import ATTENTION_KINDS
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.kinds import BUILTIN_KINDS, LAYERS, incomplete_kinds, registries
from kvjax.plan import plan_kv_cache
from kvjax.plan.kinds import (
    PlannerKind,
    PoolKind,
    planner_kind,
    planner_kinds,
    planner_kinds_of,
    pool_kinds,
    register_planner_kind,
)
from kvjax.pools.registry import require_builder
from kvjax.radix.kinds import HOST_KINDS
from kvjax.serve.kinds import SERVING_KINDS
from tests.specs import F, S, dense, mla, ssm, swa

ROOT = Path(__file__).resolve().parents[2]
KIND_NAMES = ('"swa"', '"recurrent"', '"mla"', '"mha"', '"hybrid_linear"', '"host_tier"', "SWATokenToKVPoolAllocator")
GiB = 2**30


def plan(spec, **kw):
    kw.setdefault("memory_budget_bytes", GiB)
    return plan_kv_cache(spec, CacheConfig(**kw))


def names(p) -> list[str]:
    return [k.name for k in planner_kinds_of(p)]


@pytest.mark.parametrize(
    ("spec", "kinds"),
    [
        (dense(), ["request_table", "full"]),
        (mla(), ["request_table", "mla"]),
        (swa(), ["request_table", "swa"]),
        (swa((S, S, S, S)), ["request_table", "swa"]),
        (ssm(), ["request_table", "full", "recurrent"]),
    ],
    ids=["mha", "mla", "hybrid_swa", "pure_swa", "hybrid_linear"],
)
def test_each_plan_uses_its_kinds_in_registry_order(spec, kinds):
    p = plan(spec)
    assert names(p) == kinds
    kv_kinds = [k for k in planner_kinds_of(p) if k.kv_pool_kind is not None]
    assert p.kv_pool_kind in {k.kv_pool_kind for k in kv_kinds}


def test_host_tier_and_retraction_backup_kinds_follow_the_config():
    assert names(plan(dense(), enable_hierarchical_cache=True))[-1] == "host_tier"
    assert names(plan(dense(), disaggregation_decode_retraction_backup="cpu_tensor"))[-1] == "retraction"
    assert "retraction" not in names(plan(dense()))  # resolved but not active outside decode


def test_every_builtin_kind_is_registered_in_every_layer_in_one_order():
    assert list(registries()) == list(LAYERS)  # every layer's registry is loaded by these imports
    assert incomplete_kinds() == {}
    for layer, registry in registries().items():
        assert tuple(registry.names()[: len(BUILTIN_KINDS)]) == BUILTIN_KINDS, layer


def test_every_pool_kind_belongs_to_one_cache_kind_and_has_a_builder():
    owned = [p.name for k in planner_kinds() for p in k.pool_kinds]
    assert sorted(owned) == sorted(pool_kinds()) and len(owned) == len(set(owned))
    for name in owned:
        require_builder(name, "any model")


def test_the_sliding_window_kind_decides_the_allocator_only_for_hybrid_plans():
    hybrid = plan(swa(), page_size=16)
    allocator = HOST_KINDS["swa"].allocator
    assert allocator is not None
    made = allocator(hybrid)
    assert isinstance(made, SWATokenToKVPoolAllocator) and made.size_full == hybrid.full_tokens_per_layer
    assert allocator(plan(swa((S, S, S, S)))) is None  # pure: the plain allocator


def test_only_pure_sliding_window_requests_are_windowed():
    windowed = planner_kind("swa").windowed_request_kv
    assert windowed is not None
    assert windowed(plan(swa((S, S, S, S)))) and not windowed(plan(swa((S, S, S, F))))


def test_a_kind_with_a_pool_has_attention_or_says_why_not():
    for kind in ATTENTION_KINDS:
        if kind.pool is not None:
            assert callable(kind.attention) or kind.not_attention, kind.name
    assert all(SERVING_KINDS[name].name == name for name in BUILTIN_KINDS)


def test_registering_a_taken_name_or_pool_kind_is_refused_and_changes_nothing():
    before = (planner_kinds(), pool_kinds())
    with pytest.raises(ConfigError, match="'full'"):
        register_planner_kind(PlannerKind(name="full"))
    with pytest.raises(ConfigError, match="'mha'"):
        register_planner_kind(PlannerKind(name="other", pool_kinds=(PoolKind("mha", "device", "again"),)))
    assert (planner_kinds(), pool_kinds()) == before
    with pytest.raises(ConfigError, match="cache kind"):
        planner_kind("no-such-kind")


@pytest.mark.parametrize("path", ["kvjax/build.py", "kvjax/serve/scheduler.py"])
def test_the_build_and_the_scheduler_name_no_kind(path):
    source = (ROOT / path).read_text()
    for name in KIND_NAMES:
        assert name not in source, f"{path} names {name}"
    branch = re.search(r"\.(is_hybrid_swa|is_hybrid_ssm|is_mla|is_dsa)\b", _code(source))
    assert branch is None, f"{path} branches on a kind: {branch}"


PLANNER_KIND_NAMES = ('"swa"', '"recurrent"', '"mla"', '"mha"', '"hybrid_linear"', '"mamba"', '"host_tier"')
FLAG_BRANCH = re.compile(
    r"\b(if|elif|while|and|or|not)\b[^\n]*\b(kind|plan|self)\.(is_hybrid_swa|is_hybrid_ssm|is_mla|is_dsa)\b"
)


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "kvjax" / "plan").glob("*.py")) + ["kvjax/build.py"]
)
def test_the_planner_and_the_build_name_no_kind(path):
    """The planner asks the kinds' planner hooks (``PlannerKind``) and names none of them."""
    source = _code((ROOT / path).read_text())
    for name in PLANNER_KIND_NAMES:
        assert name not in source, f"{path} names {name}"
    branch = FLAG_BRANCH.search(source)
    assert branch is None, f"{path} branches on a kind: {branch.group(0)!r}"


def _code(source: str) -> str:
    """``source`` without docstrings, comments and the ``KVCache`` properties that pass plan
    fields through (SGLang's ``KVCacheBuildResult`` names)."""
    source = re.sub(r'"""[\s\S]*?"""', "", source)
    source = re.sub(r"#.*", "", source)
    return re.sub(r"return self\.plan\.\w+", "", source)


def test_importing_the_kinds_loads_neither_jax_nor_flax():
    code = "import sys, kvjax.kinds; print(sorted(m for m in ('jax', 'flax', 'pallas_kernels') if m in sys.modules))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
