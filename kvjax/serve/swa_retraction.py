"""What the ``cpu_tensor`` retraction backup copies of a hybrid sliding-window cache's pools.

An ``SWAKVPool`` holds the full-attention layers (``full``, indexed by the full slots the request
table holds) and the sliding layers (``swa``, indexed by the SWA slot each full slot is paired
with: ``SWATokenToKVPoolAllocator.full_to_swa_index_mapping``). A retracted request's backup
(``kvjax.transfers.retraction_backup``) copies:

* the full layers at every one of its slots, ``[0, kv_len)``;
* the sliding layers of its window only, the positions from ``page_floor(kv_len - margin)`` on
  (``margin``: the serving loop's window-freeing margin, ``kvjax.serve.swa_extension.swa_margin``),
  through the mapping: exactly the positions whose SWA slots window freeing has kept, the only
  ones a query past ``kv_len`` can see.

At re-admission the fresh full slots are paired with fresh SWA slots (``alloc``); both copies are
written back, the sliding one into the SWA slots of the window's positions past the new tree
prefix. The fresh SWA slots of earlier positions hold nothing a later query reads (they are out of
every later query's window) and window freeing returns them after the resumed prefill's first
chunk, before the request's KV is cached in the tree, as for a request that was never retracted.

SGLang 0.5.23 does the same (``SWAKVPool.get_cpu_copy`` / ``load_cpu_copy``: the full pool at
every index, the SWA pool at the indices still mapped, restored into the mapped new ones). A pure
sliding-window cache (every layer sliding: the request table holds SWA slots, zero past the
window) is not backed up here (retracted requests recompute).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvjax.alloc.swa import SWATokenToKVPoolAllocator
from kvjax.plan.kinds.swa import POOL as SWA_POOL
from kvjax.plan.kinds.swa import is_pure_swa
from kvjax.serve.swa_extension import swa_margin
from kvjax.transfers.retraction_backup import CopyPart
from kvjax.transfers.transfer import PoolRef

if TYPE_CHECKING:
    from kvjax.build import KVCache

__all__ = ["swa_retraction_parts"]


def swa_retraction_parts(cache: KVCache) -> list[CopyPart] | None:
    """The full side and the window of the sliding side of ``cache``'s ``SWAKVPool`` (module
    docstring); ``None`` for a pure sliding-window cache."""
    alloc = cache.token_to_kv_pool_allocator
    window = cache.sliding_window_size
    if is_pure_swa(cache.plan) or not isinstance(alloc, SWATokenToKVPoolAllocator) or not window:
        return None
    pool = cache.pools[SWA_POOL.name]
    margin = swa_margin(int(window), alloc.page_size, cache.tree_cache)

    def to_swa(slots: np.ndarray) -> np.ndarray:
        return alloc.full_to_swa_index_mapping[slots]

    # A pipeline stage copies the sides it has layers of (kvjax.serve.pipeline_retraction).
    parts = [CopyPart(PoolRef(SWA_POOL.name, "full"))] if pool.full is not None and pool.full_layer_ids else []
    if pool.swa_layer_ids:
        parts.append(CopyPart(PoolRef(SWA_POOL.name, "swa"), window=margin, translate=to_swa))
    return parts
