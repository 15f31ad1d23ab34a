"""The storage tier (L3) in the serving loop: prefixes evicted from the device and the host come
back from storage; same tokens as with the radix cache off; both pools' accounting balances."""

from __future__ import annotations

import pytest

from kvjax.demo import demo_cache
from kvjax.errors import ConfigError
from kvjax.serve.model import init_params
from kvjax.serve.model_fingerprint import random_weights_fingerprint
from kvjax.serve.scheduler import Scheduler
from tests.serve.evicted_prefixes import SPEC, serve_one_at_a_time, twice_round


def _serve(params, **config) -> Scheduler:
    """Six system prompts twice round: more than the device (96 tokens) and host pools hold."""
    return serve_one_at_a_time(params, twice_round(6, seed=1), **config)


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
