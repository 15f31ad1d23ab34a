"""The storage tier with a speculative draft model's host pool (``kvjax.transfers.storage_attach``):
one stored entry stacks the target's and the draft's layers (``kvjax.tiers.stacked_pages``); a
draft whose host page differs from the target's is refused by name before anything is built."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache

TINY = ModelSpec.preset("tiny")


def _config(**fields: object) -> CacheConfig:
    """A small STANDALONE cache with the host tier; ``fields`` override the storage tier's."""
    storage: dict[str, object] = dict(hicache_storage_backend="memory", hicache_storage_model_fingerprint="weights")
    return CacheConfig(
        page_size=4,
        max_total_tokens=64,
        max_running_requests=2,
        context_length=32,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=2,
        speculative_num_draft_tokens=3,
        **{**storage, **fields},
    )


def test_a_stored_page_holds_the_drafts_layers_after_the_targets():
    draft = dataclasses.replace(TINY, num_hidden_layers=1, layer_kinds=TINY.layer_kinds[:1])
    cache = build_kv_cache(TINY, _config(), draft_spec=draft)
    link = cache.tree_cache.storage
    assert link.storage.page_shape == (3, 4, *cache.host_pool.page_row[1:])
    assert link.storage.storage_key.layers == (0, 1, 0)
    slots = np.arange(4, 8, dtype=np.int32)  # host page 1
    target = np.random.default_rng(0).random((2, 1, *cache.host_pool.page_row), np.float32)
    own = np.random.default_rng(1).random((1, 1, *cache.host_pool.page_row), np.float32)
    cache.host_pool.write_pages(slots, target.astype(cache.host_pool.store_dtype))
    cache.draft_host_pool.write_pages(slots, own.astype(cache.host_pool.store_dtype))
    page = link.pages.read_pages(slots)
    np.testing.assert_array_equal(page[:2], cache.host_pool.read_pages(slots))
    np.testing.assert_array_equal(page[2:], cache.draft_host_pool.read_pages(slots))
    link.pages.write_pages(slots, page[::-1].copy())  # split back: each pool its own layers
    np.testing.assert_array_equal(cache.draft_host_pool.read_pages(slots), page[:1])


def test_a_draft_of_another_head_layout_is_refused_by_name():
    draft = dataclasses.replace(TINY, num_kv_heads=1, num_attention_heads=2)
    with pytest.raises(NotImplementedError, match=r"cannot store the draft model's pages with the target's"):
        build_kv_cache(TINY, _config(), draft_spec=draft)
    build_kv_cache(TINY, _config(hicache_storage_backend=None), draft_spec=draft)  # the host tier alone serves it
