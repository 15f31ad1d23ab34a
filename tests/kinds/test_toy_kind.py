"""A cache kind registered from outside kvjax is built and served end to end.

The toy kind (``tests/kinds/toy_kind.py``) registers once per layer: a device pool the planner
adds, its builder, an attention function, a serving extension feeding the step, and a model of
its own; nothing in kvjax names it. Its model samples the
counter its pool keeps per request, so every output token checks that the pool was built, handed
to each step, updated and stored back across chunks, prefill and decode.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from kvjax import ModelSpec
from kvjax.attention import attend
from kvjax.config import CacheConfig
from kvjax.demo import demo_cache
from kvjax.errors import ConfigError
from kvjax.kinds import incomplete_kinds, kind_names, unregister_kind
from kvjax.plan import plan_kv_cache
from kvjax.plan.kinds import planner_kinds, planner_kinds_of, register_planner_kind
from kvjax.serve.kinds import SERVING_KINDS, default_extensions
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.kinds import toy_kind


@pytest.fixture
def toy_spec():
    toy_kind.register()
    try:
        yield dataclasses.replace(ModelSpec.preset("tiny"), name=toy_kind.MODEL_NAME)
    finally:
        unregister_kind(toy_kind.KIND_NAME)


def _requests() -> list[ServingReq]:
    # Distinct first tokens: no request shares a prefix with another.
    return [
        ServingReq("short", [1, 2, 3, 4, 5], max_new_tokens=4),
        ServingReq("long", [2, *range(10, 50)], max_new_tokens=6),  # 41 tokens: 3 chunks of 16
        ServingReq("mid", [3, *range(60, 80)], max_new_tokens=3),
    ]


@pytest.mark.parametrize("overlap", [True, False])
def test_toy_kind_is_built_and_served_end_to_end(toy_spec, overlap):
    cache = demo_cache(spec=toy_spec, chunked_prefill_size=16)
    assert [k.name for k in planner_kinds_of(cache.plan)][-1] == toy_kind.KIND_NAME
    assert toy_kind.POOL_NAME in cache.pools and cache.plan.pool(toy_kind.POOL_NAME).kind == toy_kind.POOL_NAME

    sched = Scheduler(
        toy_spec, cache, toy_kind.params(), max_batch_size=4, overlap=overlap, model=toy_kind.CounterModel()
    )
    (ext,) = [e for e in sched.extensions if isinstance(e, toy_kind.CounterExtension)]
    done = sched.run(_requests())

    assert len(done) == 3 and sched.leak_free()
    for req in done:
        computed = req.seqlen() - len(req.output_ids) - req.first_cached_tokens
        expected = [(computed + k) % toy_kind.VOCAB for k in range(req.max_new_tokens)]
        assert req.output_ids == expected, req.rid
    assert sorted(ext.released) == [("long", True), ("mid", True), ("short", True)]
    assert sched.stats.prefill_steps >= 3  # the long prompt was chunked: its counter carried over


def test_toy_kind_is_not_used_by_other_plans(toy_spec):
    cache = demo_cache()
    assert toy_kind.PLANNER not in planner_kinds_of(cache.plan)
    assert toy_kind.POOL_NAME not in cache.pools
    assert default_extensions(cache) == []


def test_the_toy_kind_is_complete_in_every_layer(toy_spec):
    assert toy_kind.KIND_NAME in kind_names() and incomplete_kinds() == {}


def test_unregistering_removes_the_kind_from_every_layer(toy_spec):
    assert toy_kind.PLANNER in planner_kinds()
    unregister_kind(toy_kind.KIND_NAME)
    assert toy_kind.PLANNER not in planner_kinds() and toy_kind.KIND_NAME not in SERVING_KINDS
    assert toy_kind.KIND_NAME not in kind_names()
    toy_kind.register()  # the fixture unregisters it again


def test_a_kind_registered_in_some_layers_only_is_named_where_it_is_missing(toy_spec):
    unregister_kind(toy_kind.KIND_NAME)
    register_planner_kind(toy_kind.PLANNER)
    try:
        assert incomplete_kinds()[toy_kind.KIND_NAME] == ["host", "pools", "attention", "serving"]
        cache_plan = plan_kv_cache(toy_spec, CacheConfig(memory_budget_bytes=2**24))
        with pytest.raises(ConfigError, match=r"no registration in the serving layer.*register_serving_kind"):
            default_extensions(SimpleNamespace(plan=cache_plan))  # type: ignore[arg-type]
    finally:
        unregister_kind(toy_kind.KIND_NAME)
        toy_kind.register()  # the fixture unregisters it again


def test_the_planner_asks_the_toy_kind(toy_spec):
    decode_radix = dict(
        memory_budget_bytes=2**24, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True
    )
    plan = plan_kv_cache(toy_spec, CacheConfig(memory_budget_bytes=2**24))
    assert toy_kind.KIND_NAME in plan.kind.cache_kinds
    with pytest.raises(ConfigError, match="token counter restarts"):
        plan_kv_cache(toy_spec, CacheConfig(**decode_radix))
    other = dataclasses.replace(toy_spec, name="tiny")  # the kind does not apply: nothing refused
    assert toy_kind.KIND_NAME not in plan_kv_cache(other, CacheConfig(**decode_radix)).kind.cache_kinds


def test_attend_runs_the_toy_kinds_attention_for_its_layer(toy_spec):
    cache = demo_cache(spec=toy_spec)
    q = jnp.ones((5, 2, 4), jnp.float32)
    out, pools = attend(cache.pools, toy_kind.COUNTER_LAYER, q, q, q, meta=None)  # type: ignore[arg-type]
    assert out is q and int(pools[toy_kind.POOL_NAME][-1]) == 5
    assert pools["kv"] is cache.pools["kv"]  # only the counter's pool was replaced
