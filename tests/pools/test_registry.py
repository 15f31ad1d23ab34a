"""The pool kinds (declared by the planner kinds) and their builders (the pools layer): every kind names its
capability; unbuilt kinds refuse; builders dispatch."""

from __future__ import annotations

import pytest

from kvjax import ConfigError
from kvjax.layout.mha import MHALayout
from kvjax.plan.kinds import PoolKind, is_built, pool_kind, pool_kinds
from kvjax.pools.registry import BuildContext, create_pool, require_builder


def test_every_planned_kind_has_an_entry():
    assert set(pool_kinds()) == {"mha", "mla", "swa", "recurrent", "host_tier", "host_state", "request_table"}
    for kind in pool_kinds().values():
        assert kind.capability and kind.memory in ("device", "host")


def test_every_planned_kind_is_built_and_has_a_builder():
    assert all(is_built(name) for name in pool_kinds())
    for name in pool_kinds():
        require_builder(name, "any model")  # raises for a pool kind without a registered builder


def test_a_kind_without_a_builder_raises_naming_its_capability():
    kind = PoolKind("paged_mla_v2", "device", "a future latent pool", built=False)
    assert not kind.built
    with pytest.raises(NotImplementedError, match="kvjax cannot build") as e:
        kind.require_built("some-model")
    assert kind.capability in str(e.value) and "some-model" in str(e.value)


def test_unknown_kind_is_a_config_error_listing_the_kinds():
    with pytest.raises(ConfigError, match="'mha'"):
        pool_kind("paged_mla_v2")


def test_mha_builder_creates_the_pool_the_plan_describes():
    layout = MHALayout.for_platform(
        num_kv_heads=2, head_dim=8, v_head_dim=8, page_size=4, dtype="float32", platform="cpu"
    )
    planned = layout.pool_plan("kv", "mha", num_pages=3, layer_ids=(0, 1))
    pool = create_pool(planned, BuildContext(platform="cpu"))
    assert pool.num_layers == 2 and pool.kv[0].shape == planned.shape == (4, 4, 4, 8)
    assert pool.nbytes() == planned.nbytes


def test_mha_builder_maps_interleaved_layers():
    layout = MHALayout.for_platform(
        num_kv_heads=1, head_dim=8, v_head_dim=8, page_size=4, dtype="float32", platform="cpu"
    )
    planned = layout.pool_plan("kv_full", "mha", num_pages=3, layer_ids=(1, 3))
    pool = create_pool(planned, BuildContext(platform="cpu"))
    assert pool.layer_ids == (1, 3) and pool.layer_index(3) == 1
    with pytest.raises(ValueError, match=r"layer_id=2 not in full attention layers: \[1, 3\]"):
        pool.layer_index(2)


def test_request_table_builder():
    from kvjax.config import CacheConfig
    from kvjax.plan import plan_kv_cache
    from tests.specs import dense

    planned = plan_kv_cache(dense(), CacheConfig(max_total_tokens=256, max_running_requests=3, context_length=60)).pool(
        "req_to_token"
    )
    table = create_pool(planned, BuildContext(platform="cpu"))
    assert table.req_to_token.shape == planned.shape == (3, 64)


def test_host_tier_builder_creates_the_planned_host_pool():
    from kvjax.config import CacheConfig
    from kvjax.plan import plan_kv_cache
    from tests.specs import dense

    config = CacheConfig(enable_hierarchical_cache=True, max_total_tokens=64, page_size=4, platform="cpu")
    plan = plan_kv_cache(dense(layers=2), config)
    planned = next(p for p in plan.pools if p.kind == "host_tier")
    host = create_pool(planned, BuildContext(platform="cpu", host_layout="page_first"))
    assert host.size == plan.host_pool_tokens == 132  # 64 tokens, ratio 2, page 4
    assert host.layout.name == "page_first" and host.num_layers == 2
    assert host.nbytes == planned.nbytes  # the plan's host bytes are what the build allocates
