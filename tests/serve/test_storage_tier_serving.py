"""The storage tier (L3) in the serving loop: prefixes evicted from the device and the host come
back from storage; same tokens as with the radix cache off; both pools' accounting balances."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import ModelSpec
from kvjax.demo import demo_cache
from kvjax.errors import ConfigError
from kvjax.serve.model import init_params
from kvjax.serve.model_fingerprint import random_weights_fingerprint
from kvjax.serve.scheduler import Scheduler, ServingReq

SPEC = ModelSpec.preset("tiny")


def _requests() -> list[ServingReq]:
    """Six 48-token system prompts, twice round: more than the device (96) and host pools hold."""
    rng = np.random.default_rng(1)
    systems = [[int(t) for t in rng.integers(0, 256, 48)] for _ in range(6)]
    out = []
    for rnd in range(2):
        for i, s in enumerate(systems):
            out.append(ServingReq(f"r{rnd}-{i}", s + [int(t) for t in rng.integers(0, 256, 4)], max_new_tokens=3))
    return out


def _serve(params, **config) -> Scheduler:
    cache = demo_cache(page_size=4, max_total_tokens=96, chunked_prefill_size=64, **config)
    sched = Scheduler(SPEC, cache, params, max_batch_size=2)
    for req in _requests():
        sched.run([req])
    return sched


def test_storage_serves_prefixes_evicted_from_device_and_host_with_cold_tokens(tmp_path):
    params = init_params(SPEC)
    cold = _serve(params, disable_radix_cache=True)
    host = _serve(params, enable_hierarchical_cache=True)
    l3 = _serve(
        params,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "l3"),
        hicache_storage_model_fingerprint=random_weights_fingerprint(SPEC, seed=0),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_prefetch_threshold=16,
    )
    outputs = [r.output_ids for r in cold.finished]
    assert [r.output_ids for r in host.finished] == outputs
    assert [r.output_ids for r in l3.finished] == outputs
    [ext] = l3.extensions
    # Cycling through six prompts evicts each from the host (196 tokens) before its second
    # round: the host tier alone reuses nothing, storage brings every round-2 prompt back.
    assert host.stats.cached_tokens == 0
    assert l3.stats.cached_tokens == ext.prefetched_tokens == ext.loaded_tokens == 6 * 48
    tree = l3.cache.tree_cache
    tree.check_transfers(wait=True)
    assert tree.storage.pending_prefetches == 0
    assert l3.leak_free() and ext.host_balanced()
    tree.sanity_check()


def test_storage_knobs_are_checked():
    with pytest.raises(ConfigError, match="hicache_storage_backend"):
        demo_cache(page_size=4, max_total_tokens=96, hicache_storage_backend="memory")  # no host tier
    with pytest.raises(ConfigError, match="hicache_storage_dir"):
        demo_cache(page_size=4, max_total_tokens=96, enable_hierarchical_cache=True, hicache_storage_backend="file")
    with pytest.raises(ConfigError, match="hicache_storage_model_fingerprint=None: the storage tier keys pages"):
        demo_cache(page_size=4, max_total_tokens=96, enable_hierarchical_cache=True, hicache_storage_backend="memory")
