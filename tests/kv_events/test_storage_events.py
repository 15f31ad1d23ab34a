"""The storage tier reports its pages (medium "storage", ``"CPU_TIER2"`` on the wire) once their
write lands, keeps reporting them after the tree forgets their nodes (the store keeps them), and a
reset clears them with everything else; a prefetch from storage reports the host copy it makes."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.kv_events.block_hash import Sha256CborHasher
from kvjax.kv_events.blocks import cached_blocks
from kvjax.radix import HiRadixCache
from kvjax.radix import events as tree_events
from kvjax.tiers.storage import StorageTier
from kvjax.tiers.storage_key import StorageKey

pytest.importorskip("tensorstore")

PAGE = (2, 4, 1, 2)  # layers, page_size, C, D
KEY = StorageKey(model="events-test", page_shape=PAGE, store_dtype="uint16", kv_dtype="bfloat16")


def _replayed(stream: list, hasher) -> set:
    blocks: set = set()
    for e in stream:
        if isinstance(e, tree_events.BlockStored):
            blocks |= {(e.medium, hasher.wire_hash(h)) for h in e.block_hashes}
        elif isinstance(e, tree_events.BlockRemoved):
            blocks -= {(e.medium, hasher.wire_hash(h)) for h in e.block_hashes}
        else:
            blocks.clear()
    return blocks


@pytest.mark.parametrize("vllm_hash", [False, True], ids=["kvjax", "sha256_cbor"])
def test_storage_pages_are_reported_and_outlive_their_nodes(vllm_hash):
    cache = HiRadixCache(page_size=4, host_pool_tokens=16, storage=StorageTier("memory", key=KEY), prefetch_threshold=8)
    stream: list = []
    cache.start_events(stream, Sha256CborHasher("0") if vllm_hash else None)
    hasher = cache.block_hasher
    tokens = list(range(1, 13))
    cache.insert(tokens)
    node = cache.match_prefix(tokens).last_node
    assert cache.storage is not None
    pages = np.random.default_rng(0).integers(1, 2**16, (PAGE[0], 3, *PAGE[1:]), np.uint16)
    cache.storage.pages.write_pages(cache.host.data(node).slots, pages)
    cache.check_transfers(wait=True)  # the host copy lands, its storage write starts
    cache.check_transfers(wait=True)  # the storage write lands
    media = {m for m, _ in cached_blocks(cache, wire_media=False)}
    assert media == {"device", "host", "storage"}
    assert _replayed(stream, hasher) == cached_blocks(cache, wire_media=False)
    cache.evict(12)
    cache.evict_host(12)
    left = cached_blocks(cache, wire_media=False)
    assert {m for m, _ in left} == {"storage"} and len(left) == 3, "the store keeps what the tree forgot"
    assert _replayed(stream, hasher) == left
    query = [*tokens, 99]
    assert cache.start_prefetch("r", cache.match_prefix(query), query) == 12
    assert cache.check_prefetch_progress("r")
    assert {m for m, _ in cached_blocks(cache, wire_media=False)} == {"host", "storage"}
    assert _replayed(stream, hasher) == cached_blocks(cache, wire_media=False)
    cache.reset()
    assert isinstance(stream[-1], tree_events.AllBlocksCleared)
    assert _replayed(stream, hasher) == cached_blocks(cache, wire_media=False) == set()
