"""Tenant isolation (issue 37): two tenants with the same prompt never share a page, at any tier.

Tenant ``a`` serves a prompt; then the same prompt (with another question) comes from ``a`` again
and from ``b``. The matrix, for each tier the page can be in when it comes back:

=========  =============================================  ====================================
tier       same tenant                                    other tenant
=========  =============================================  ====================================
device     the prefix is matched in the tree               nothing matched
host       the prefix is loaded back from the host tier   nothing loaded, nothing matched
storage    the prefix is prefetched from storage          nothing prefetched, nothing matched
events     the pages' hashes are the ones already stored  every page hashes differently (kvjax's
                                                          hash and vLLM's sha256_cbor alike)
router     the DP router sees the prefix on its rank       no rank holds any of it
=========  =============================================  ====================================

The other tenant's tokens are the same as the first's (same prompt, same weights): isolation
changes what is reused, never what is computed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvjax.demo import demo_cache
from kvjax.radix import BlockStored
from kvjax.serve.dp_router import DPRouter
from kvjax.serve.model import init_params
from kvjax.serve.model_fingerprint import random_weights_fingerprint
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.evicted_prefixes import SPEC

PAGE = 4
SYSTEM = 48  # the shared prompt: 12 pages


def _prompts() -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(11)
    system = [int(t) for t in rng.integers(0, 256, SYSTEM)]
    questions = [[int(t) for t in rng.integers(0, 256, 4)] for _ in range(3)]
    return system, questions


def _req(rid: str, tokens: list[int], salt: str) -> ServingReq:
    return ServingReq(rid, tokens, max_new_tokens=3, cache_salt=salt)


@pytest.fixture(scope="module")
def params():
    return init_params(SPEC)


@pytest.mark.parametrize("block_hash", ["kvjax", "sha256_cbor"])
def test_device_tier_hits_for_the_same_tenant_only(params, block_hash):
    system, (q0, q1, q2) = _prompts()
    sched = Scheduler(SPEC, demo_cache(page_size=PAGE, max_total_tokens=512), params)
    hasher = None
    if block_hash == "sha256_cbor":  # vLLM's, which a router recomputes from token ids and the salt
        from kvjax.kv_events.block_hash import Sha256CborHasher

        hasher = Sha256CborHasher("0")
    sched.tree.start_events(None, hasher)
    first = _req("a0", system + q0, "a")
    same = _req("a1", system + q1, "a")
    other = _req("b1", system + q1, "b")
    other_again = _req("b2", system + q2, "b")
    for req in (first, same, other, other_again):
        sched.run([req])
    assert same.first_cached_tokens == SYSTEM
    assert other.first_cached_tokens == 0
    assert other_again.first_cached_tokens == SYSTEM  # b's own copy
    assert other.output_ids == same.output_ids
    # The KV events: b's pages of the same tokens hash differently from a's, page by page.
    stored = [e for e in sched.tree.take_events() if isinstance(e, BlockStored)]
    by_tenant: dict[str, set[int]] = {"a": set(), "b": set()}
    for event in stored:
        by_tenant[str(event.extra_key)].update(event.block_hashes)
    assert by_tenant["a"] and by_tenant["b"] and not by_tenant["a"] & by_tenant["b"]
    if hasher is not None:  # a router holding only the tokens and the salt computes the same hashes
        for salt in ("a", "b"):
            recomputed = {hasher.page_hashes(None, system + q1, PAGE, salt)[i] for i in range(SYSTEM // PAGE)}
            assert recomputed <= by_tenant[salt]
    assert sched.leak_free()


def test_host_tier_loads_back_for_the_same_tenant_only(params):
    system, (q0, q1, q2) = _prompts()
    rng = np.random.default_rng(12)
    cache = demo_cache(page_size=PAGE, max_total_tokens=96, chunked_prefill_size=64, enable_hierarchical_cache=True)
    sched = Scheduler(SPEC, cache, params, max_batch_size=2)
    [ext] = sched.extensions

    # The 96-token pool holds one 52-token prompt: each request evicts the one before to the host.
    sched.run([_req("a0", system + q0, "a")])
    sched.run([_req("f0", [int(t) for t in rng.integers(0, 256, 52)], "a")])
    assert sched.tree.match_prefix(system, "a").indices.size == 0  # a0's prefix is on the host only
    other = _req("b1", system + q1, "b")
    sched.run([other])
    assert other.first_cached_tokens == 0 and ext.loaded_tokens == 0
    same = _req("a1", system + q1, "a")
    sched.run([same])
    assert same.first_cached_tokens == SYSTEM and ext.loaded_tokens == SYSTEM
    assert other.output_ids == same.output_ids
    cache.tree_cache.check_transfers(wait=True)
    assert sched.leak_free() and ext.host_balanced()


def _storage_scheduler(params, store: Path) -> Scheduler:
    cache = demo_cache(
        page_size=PAGE,
        max_total_tokens=96,
        chunked_prefill_size=64,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(store),
        hicache_storage_model_fingerprint=random_weights_fingerprint(SPEC, seed=0),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_prefetch_threshold=PAGE,
    )
    return Scheduler(SPEC, cache, params, max_batch_size=2)


def test_storage_tier_prefetches_for_the_same_tenant_only(params, tmp_path):
    system, (q0, q1, _) = _prompts()
    store = tmp_path / "l3"
    writer = _storage_scheduler(params, store)
    writer.run([_req("a0", system + q0, "a")])
    writer.cache.tree_cache.check_transfers(wait=True)
    writer.cache.tree_cache.storage.check_writes(wait=True)
    # A fresh server over the same store: nothing on its device or host.
    reader = _storage_scheduler(params, store)
    storage = reader.cache.tree_cache.storage
    other = _req("b1", system + q1, "b")
    reader.run([other])
    assert other.first_cached_tokens == 0 and storage.prefetched_tokens == 0
    reader2 = _storage_scheduler(params, store)
    same = _req("a1", system + q1, "a")
    reader2.run([same])
    assert same.first_cached_tokens == SYSTEM and reader2.cache.tree_cache.storage.prefetched_tokens == SYSTEM
    assert other.output_ids == same.output_ids
    for sched in (writer, reader, reader2):
        sched.cache.tree_cache.check_transfers(wait=True)
        assert sched.leak_free()


def test_the_dp_router_sees_a_prefix_on_a_rank_for_its_own_tenant_only(params):
    system, (q0, q1, _) = _prompts()
    ranks = [Scheduler(SPEC, demo_cache(page_size=PAGE, max_total_tokens=512), params) for _ in range(2)]
    ranks[1].run([_req("a0", system + q0, "a")])
    router = DPRouter([s.tree for s in ranks], "cache_aware")
    assert router.cached_prefixes(system + q1, "a") == [0, SYSTEM]
    assert router.cached_prefixes(system + q1, "b") == [0, 0]


def test_a_salt_and_a_different_extra_key_are_refused():
    with pytest.raises(ValueError, match="cache_salt='a' and extra_key='b' differ"):
        ServingReq("r", [1, 2], max_new_tokens=1, cache_salt="a", extra_key="b")
    with pytest.raises(ValueError, match="cache_salt=''"):
        ServingReq("r", [1, 2], max_new_tokens=1, cache_salt="")
    assert ServingReq("r", [1, 2], max_new_tokens=1, cache_salt="a").extra_key == "a"


def test_generate_salts_each_prompt_from_the_command_line(capsys):
    import json

    from kvjax.cli import main

    shared = ",".join(str(t) for t in range(1, 21))
    argv = ["generate", "--model", "tiny", "--max-new-tokens", "2", "--page-size", "1", "--json"]
    for tail in (30, 31, 32):
        argv += ["--prompt-ids", f"{shared},{tail}"]
    assert main([*argv, "--cache-salt", "a", "--cache-salt", "b", "--cache-salt", "a"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cached_tokens"] == 20  # the third prompt (tenant a) reuses the first's; the second none
    assert main([*argv, "--cache-salt", "a", "--cache-salt", "b"]) == 2
    assert "--cache-salt is given 2 times for 3 prompts" in capsys.readouterr().err
