"""A model served by one scheduler, and the dp-2 configuration, that the DP serving tests
compare: DP serving must give the single scheduler's tokens.

Both use the demo's settings (``kvjax.demo_config``) with a 2048-token pool per rank and a
512-token context; the DP configuration has 2 ranks of one device each, with DP attention.
"""

from __future__ import annotations

from typing import Any

import jax

from kvjax import CacheConfig, ModelSpec
from kvjax.demo import demo_cache
from kvjax.demo_config import MAX_BATCH, demo_config
from kvjax.serve.model import Params, init_params
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.workload import Workload, run_workload

POOL_TOKENS = 2048  # per rank
CONTEXT_LENGTH = 512


def single_scheduler_outputs(spec: ModelSpec, params: Params, workload: Workload) -> dict[str, list[int]]:
    """Each request's output tokens, by name, served by one ``Scheduler`` over one cache."""
    cache = demo_cache(max_total_tokens=POOL_TOKENS, context_length=CONTEXT_LENGTH)
    return run_workload(Scheduler(spec, cache, params, max_batch_size=MAX_BATCH), workload)


def tiny_dp2_setup(workload: Workload) -> tuple[ModelSpec, Params, dict[str, list[int]], jax.sharding.Mesh]:
    """What the lockstep DP checks start from: the tiny model, its weights (seed 0), one
    scheduler's outputs for ``workload`` (``single_scheduler_outputs``) and the ``("data", "tp")``
    mesh of 2 x 1 host devices."""
    spec = ModelSpec.preset("tiny")
    params = init_params(spec, seed=0)
    expected = single_scheduler_outputs(spec, params, workload)
    return spec, params, expected, jax.make_mesh((2, 1), ("data", "tp"))


def dp2_config(**changes: Any) -> CacheConfig:
    """The demo configuration over 2 DP ranks of one device each (``tp_size`` 2, ``dp_size`` 2,
    DP attention); ``changes`` are more ``demo_config`` settings."""
    config = demo_config(max_total_tokens=POOL_TOKENS, context_length=CONTEXT_LENGTH, **changes)
    return config.replace(tp_size=2, dp_size=2, enable_dp_attention=True)
