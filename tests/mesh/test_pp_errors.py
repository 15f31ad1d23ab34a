"""Bad pipeline-parallel input: one ``ConfigError`` naming the option, the value and the fix, raised
before anything is allocated (``jax.live_arrays()`` unchanged).

More stages than layers, more ``pp_size * tp_size`` devices than there are, and what pipelining
does not serve (DP attention, the host tier of a model with recurrent layers, a ``pp_rank``
other than 0) are refused by
``build_pipeline_cache``; a micro-batch count the batch cannot be split into by
``pipeline_scheduler``.
"""

from __future__ import annotations

import jax
import pytest

from kvjax import CacheConfig
from kvjax.errors import ConfigError
from kvjax.serve.model import init_params
from kvjax.serve.pipeline_cache import build_pipeline_cache
from kvjax.serve.pipeline_stepping import pipeline_scheduler
from kvjax.spec import ModelSpec

TINY = ModelSpec.preset("tiny")  # 2 layers, 2 KV heads


def config(**fields) -> CacheConfig:
    return CacheConfig(max_total_tokens=64, max_running_requests=4, **fields)


CASES = {
    "more_stages_than_layers": (TINY, config(pp_size=3), "pp_size", "at most 2 pipeline stages"),
    "more_devices_than_there_are": (TINY, config(pp_size=2, tp_size=8), "pp_size", "need 16 devices"),
    "dp_attention": (
        TINY,
        config(pp_size=2, tp_size=2, dp_size=2, enable_dp_attention=True),
        "enable_dp_attention",
        "DP attention",
    ),
    "recurrent_layers_with_the_host_tier": (
        ModelSpec.preset("qwen3-next-80b-a3b"),
        config(pp_size=2, memory_budget_bytes=1 << 30, enable_hierarchical_cache=True),
        "enable_hierarchical_cache",
        "recurrent-state checkpoints over pipeline stages",
    ),
    "pp_rank": (TINY, config(pp_size=2, pp_rank=1), "pp_rank", "leave pp_rank 0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_anything_is_allocated(case):
    spec, cache_config, option, words = CASES[case]
    before = len(jax.live_arrays())
    with pytest.raises(ConfigError) as err:
        build_pipeline_cache(spec, cache_config, devices=jax.devices())
    assert err.value.option == option, str(err.value)
    assert words in str(err.value), str(err.value)
    assert len(jax.live_arrays()) == before, "arrays were allocated before the refusal"


@pytest.mark.parametrize("micro_batches", [0, 5])
def test_micro_batches_outside_the_batch_are_refused(micro_batches):
    pipeline = build_pipeline_cache(TINY, config(pp_size=2), devices=jax.devices())
    with pytest.raises(ConfigError, match="micro_batches"):
        pipeline_scheduler(TINY, pipeline, init_params(TINY), micro_batches=micro_batches, max_batch_size=4)
