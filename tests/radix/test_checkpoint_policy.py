"""Checkpoint policies: which caching points donate a checkpoint, in the lifecycle too."""

from __future__ import annotations

import pytest

from kvjax.alloc import TokenToKVPoolAllocator
from kvjax.hybrid_req_pool import HybridReqToTokenPool
from kvjax.radix import MambaRadixCache
from kvjax.radix.checkpoint_policy import POLICIES, CheckpointPolicy
from kvjax.request import Req


def test_points_and_names():
    policy = CheckpointPolicy(chunk_ends=False)
    assert policy.point(10, 4, False) == "chunk_ends" and not policy.keeps("chunk_ends")
    assert policy.point(10, 10, False) == "prompt_end" and policy.keeps("prompt_end")
    assert policy.point(10, 12, True) == "turn_end"
    assert POLICIES["all"].name == "chunk_ends+prompt_end+turn_end" and POLICIES["none"].name == "none"
    with pytest.raises(ValueError, match="unknown checkpoint point"):
        policy.keeps("decode")


@pytest.mark.parametrize("policy,hit", [("all", 4), ("turn_end", 6), ("prompt_end", 6), ("chunk_ends", 4), ("none", 0)])
def test_lifecycle_follows_the_policy(policy, hit):
    kv = TokenToKVPoolAllocator(64)
    table = HybridReqToTokenPool(2, 32, mamba_size=8)
    tree = MambaRadixCache(allocator=kv, req_to_token_pool=table, checkpoint_policy=POLICIES[policy])
    a = Req("a", [1, 2, 3, 4, 5, 6])
    tree.match_and_lock(a)
    table.alloc_reqs([a])
    table.write(a.req_pool_idx, 0, kv.alloc(6))
    a.fill_ids = [1, 2, 3, 4]  # a chunk ended
    tree.cache_unfinished_req(a)
    a.fill_ids = None
    a.kv_committed_len = 6
    if policy == "prompt_end":
        a.fill_ids = [1, 2, 3, 4, 5, 6]
        tree.cache_unfinished_req(a)  # the prompt is done
        a.fill_ids = None
    tree.cache_finished_req(a)
    table.free_req(a)
    assert tree.total_size() == 6, "skipped points still cache their KV"
    if policy == "all":
        hit = 6  # the finish donates one at 6 as well
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7]).prefix_len == hit
    held = tree.mamba_evictable_size()
    assert table.mamba_allocator.available_size() + held == 8, "every slot the tree did not take is free"
    tree.sanity_check()
