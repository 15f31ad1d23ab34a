"""A workload whose prefixes the device pool cannot keep: system prompts served twice round, one
request at a time, on the demo cache's 96-token pool (the tier tests' shared setting)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvjax import ModelSpec
from kvjax.demo import demo_cache
from kvjax.serve.scheduler import Scheduler, ServingReq

SPEC = ModelSpec.preset("tiny")


def twice_round(systems: int, seed: int) -> list[ServingReq]:
    """``systems`` 48-token system prompts, each followed by 4 question tokens, twice round
    (3 new tokens each): a round-2 request's prefix is the one served ``systems`` requests before."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, 256, 48)] for _ in range(systems)]
    out = []
    for rnd in range(2):
        for i, s in enumerate(prompts):
            out.append(ServingReq(f"r{rnd}-{i}", s + [int(t) for t in rng.integers(0, 256, 4)], max_new_tokens=3))
    return out


def serve_one_at_a_time(params: Any, reqs: list[ServingReq], **config: Any) -> Scheduler:
    """Serve ``reqs`` one after another (each arrives after the ones before it finished, so the
    others' prefixes have evicted it) on a 96-token pool of 4-token pages; ``config``: more
    :func:`kvjax.demo.demo_cache` settings."""
    cache = demo_cache(page_size=4, max_total_tokens=96, chunked_prefill_size=64, **config)
    sched = Scheduler(SPEC, cache, params, max_batch_size=2)
    for req in reqs:
        sched.run([req])
    return sched
