"""Serving over DP ranks: a router in front of one scheduler per rank gives the single-rank
scheduler's tokens, cold == warm, and no rank leaks."""

from __future__ import annotations

import pytest

from kvjax import ModelSpec
from kvjax.demo_config import MAX_BATCH, demo_config
from kvjax.dp.scheduler import DPScheduler
from kvjax.errors import ConfigError
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import ServingReq
from kvjax.serve.workload import run_workload
from tests.serve.dp_serving import dp2_config, single_scheduler_outputs
from tests.workloads import SMALL_THREE_GROUPS as WORKLOAD


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.preset("tiny")


@pytest.fixture(scope="module")
def params(spec):
    return init_params(spec, seed=0)


def _front(spec, params, policy: str, **config) -> DPScheduler:
    return DPScheduler.build(spec, dp2_config(**config), params, policy=policy, max_batch_size=MAX_BATCH)


@pytest.fixture(scope="module")
def single(spec, params):
    return single_scheduler_outputs(spec, params, WORKLOAD)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_dp2_front_serves_the_single_rank_tokens_cold_equals_warm_no_leak(spec, params, single, policy):
    cold = _front(spec, params, policy, disable_radix_cache=True)
    cold_out = run_workload(cold, WORKLOAD)
    warm = _front(spec, params, policy)
    warm_out = run_workload(warm, WORKLOAD)
    assert warm_out == single
    assert cold_out == warm_out
    assert cold.leak_free() and warm.leak_free()
    for s in warm.schedulers:
        assert s.stats.requests_finished > 0
    assert cold.cached_tokens == 0
    if policy == "cache_aware":  # round robin splits each group over both ranks, in one prefill batch each
        assert warm.cached_tokens > 0
    assert sorted(set(warm.rank_of.values())) == [0, 1]


def test_cache_aware_front_keeps_each_group_on_one_rank(spec, params):
    front = _front(spec, params, "cache_aware")
    run_workload(front, WORKLOAD)
    for g in range(WORKLOAD.groups):
        assert len({front.rank_of[f"g{g}.{i}"] for i in range(WORKLOAD.prompts_per_group)}) == 1


def test_front_refuses_bad_input_before_routing(spec, params):
    front = _front(spec, params, "cache_aware")
    with pytest.raises(ConfigError, match="context_length"):
        front.submit([ServingReq("ok", [1, 2, 3], max_new_tokens=2), ServingReq("long", [1] * 600, max_new_tokens=2)])
    assert front.idle and front.router.routed == 0 and not front.rank_of
    cfg = demo_config(max_total_tokens=2048).replace(tp_size=2, dp_size=2)
    with pytest.raises(ConfigError, match="enable_dp_attention"):
        DPScheduler.build(spec, cfg, params)
    with pytest.raises(NotImplementedError, match="tp_size / dp_size = 2"):
        DPScheduler.build(spec, cfg.replace(tp_size=4, enable_dp_attention=True), params)
