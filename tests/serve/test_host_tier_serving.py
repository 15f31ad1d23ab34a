"""The host tier in the serving loop: a device pool smaller than the working set, prefixes
evicted to the host and loaded back at admission; same tokens as without it and as with the radix
cache off; both pools' accounting balances."""

from __future__ import annotations

from kvjax.radix import HiRadixCache
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler
from tests.serve.evicted_prefixes import SPEC, serve_one_at_a_time, twice_round


def _serve(params, **config) -> Scheduler:
    """Three system prompts twice round: the device pool (96 tokens) holds one."""
    return serve_one_at_a_time(params, twice_round(3, seed=0), **config)


def test_host_tier_serves_evicted_prefixes_from_host_with_the_same_tokens():
    params = init_params(SPEC)
    plain = _serve(params)  # no prefix is ever reused: these are the cold tokens
    host = _serve(params, enable_hierarchical_cache=True)
    assert [r.output_ids for r in host.finished] == [r.output_ids for r in plain.finished]
    assert plain.stats.cached_tokens == 0 and plain.stats.evicted_tokens > 0
    [ext] = host.extensions
    assert isinstance(ext, HostTierExtension) and isinstance(host.cache.tree_cache, HiRadixCache)
    assert host.stats.cached_tokens == ext.loaded_tokens == 3 * 48  # every round-2 prompt from host
    assert host.stats.prefill_tokens_computed < plain.stats.prefill_tokens_computed
    host.cache.tree_cache.check_transfers(wait=True)
    assert host.leak_free() and ext.host_balanced()
    host.cache.tree_cache.sanity_check()


def test_generate_with_the_host_tier_reuses_an_evicted_prompt():
    from kvjax.serve.generate import generate, resolve_model

    model = resolve_model("tiny")
    shared = list(range(1, 49))
    prompts = [shared + [1, 2, 3], list(range(100, 148)) + [5], shared + [7, 8, 9]]
    kw = dict(max_new_tokens=3, page_size=4, max_total_tokens=64, stop_token_ids=())
    plain, _ = generate(model, prompts, **kw)
    host, sched = generate(model, prompts, enable_hierarchical_cache=True, **kw)
    assert host.outputs == plain.outputs
    assert (plain.cached_tokens, host.cached_tokens) == (0, 48)
    assert sched.leak_free()
