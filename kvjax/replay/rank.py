"""`ReplayRank`: one serving rank's KV cache, host-only: kvjax's radix tree over its real page
allocator and request table, driven through the request lifecycle of a serving loop.

One request, served alone (``serve``):

1. take a request-table row; ``match_and_lock``: the longest cached page-aligned prefix of the
   prompt (at most all but its last token), locked;
2. host tier on, and a host hit of at least the load-back threshold beyond the device match: load
   it back (``init_load_back``) and move the lock to the loaded node, as the serving loop's host
   tier extension does;
3. allocate slots for the rest of the prompt and every output token (``alloc_extend`` from the
   matched prefix); when the allocator is short, evict the tree (``evict``) by the shortfall and
   try once more; still short (the request does not fit beside what is locked, or not at all):
   release it unserved and count it as too large;
4. write the row, append the outputs (fresh tokens) and ``cache_finished_req``: the tree keeps
   the page-aligned prompt + outputs, frees duplicates and the partial tail, releases the lock;
   free the row; poll the host tier's copies (``check_transfers``).

Invariant after every request: nothing is locked by a request, and the allocator's used slots
are exactly the tree's device tokens. Units: tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvjax.alloc import make_allocator
from kvjax.radix import HiRadixCache, RadixCache
from kvjax.radix.eviction import EvictionPolicy
from kvjax.replay.counting_copy import CountingCopyEngine
from kvjax.req_pool import ReqToTokenPool
from kvjax.request import Req

__all__ = ["RequestOutcome", "ReplayRank"]


@dataclasses.dataclass(frozen=True)
class RequestOutcome:
    """What serving one request did.

    Attributes:
        served: False when the request did not fit (it was released without running).
        device_hit_tokens: prompt tokens found on the device at admission.
        host_hit_tokens: prompt tokens loaded back from the host tier (beyond the device hit).
    """

    served: bool
    device_hit_tokens: int
    host_hit_tokens: int


class ReplayRank:
    """One rank's cache (module docstring).

    Args:
        capacity_tokens: device KV slots (rounded down to whole pages).
        page_size: tokens per page (>= 1).
        eviction_policy: a policy name of ``kvjax.radix.eviction`` or a policy object.
        host_capacity_tokens: host tier slots (rounded down to whole pages); 0: no host tier.
        max_request_tokens: the longest prompt + output the trace holds (the request row's width).

    Attributes:
        peak_used_tokens: the most device slots in use at once (tree + the running request).
        loads: load-backs from the host tier.
    """

    def __init__(
        self,
        capacity_tokens: int,
        page_size: int,
        eviction_policy: str | EvictionPolicy,
        host_capacity_tokens: int,
        max_request_tokens: int,
    ) -> None:
        self.page_size = page_size
        self.allocator = make_allocator(capacity_tokens, page_size)
        self.req_pool = ReqToTokenPool(1, max_request_tokens + page_size)
        self.engine: CountingCopyEngine | None = None
        self.tree: Any
        if host_capacity_tokens:
            self.engine = CountingCopyEngine()
            self.tree = HiRadixCache(
                page_size,
                eviction_policy,  # type: ignore[arg-type]  # a policy object is accepted as by RadixCache
                host_pool_tokens=host_capacity_tokens - host_capacity_tokens % page_size,
                copy_engine=self.engine,
                token_to_kv_pool_allocator=self.allocator,
                req_to_token_pool=self.req_pool,
            )
        else:
            self.tree = RadixCache(
                page_size,
                eviction_policy,
                token_to_kv_pool_allocator=self.allocator,
                req_to_token_pool=self.req_pool,
            )
        self.peak_used_tokens = 0
        self.loads = 0

    def serve(self, rid: int, prompt: np.ndarray, outputs: np.ndarray) -> RequestOutcome:
        """Serve one request: ``prompt`` and ``outputs`` token ids (int32). See the module docstring."""
        tree = self.tree
        rows = self.req_pool.alloc(1)
        assert rows is not None, "the replay serves one request at a time"
        row = rows[0]
        req = Req(rid, prompt, req_pool_idx=row)
        tree.match_and_lock(req)
        device_hit = req.cache_protected_len
        if self.engine is not None:
            self._load_back(req)
        prefix = req.cache_protected_len
        if prefix:
            self.req_pool.write(row, 0, req.prefix_indices[:prefix])
        total = int(prompt.shape[0]) + int(outputs.shape[0])
        slots = self._allocate(req, prefix, total)
        if slots is None:
            tree.dec_lock_ref(req.lock_receipt if req.lock_receipt is not None else req.last_node)
            self.req_pool.free(row)
            return RequestOutcome(False, device_hit, prefix - device_hit)
        used = self.allocator.size - self.allocator.available_size()
        if used > self.peak_used_tokens:
            self.peak_used_tokens = used
        self.req_pool.write(row, prefix, slots)
        req.output_ids = outputs  # type: ignore[assignment]  # Req reads arrays as it reads lists
        tree.cache_finished_req(req)
        self.req_pool.free(row)
        if self.engine is not None:
            tree.check_transfers()
        return RequestOutcome(True, device_hit, prefix - device_hit)

    def _allocate(self, req: Req, prefix: int, total: int) -> np.ndarray | None:
        """Slots for tokens ``[prefix, total)``, evicting the shortfall once; None: does not fit."""
        alloc = self.allocator
        ps = self.page_size
        last = int(req.prefix_indices[prefix - 1]) if prefix else -1
        slots = alloc.alloc_extend([prefix], [total], [last])
        if slots is None:
            need = (-(-total // ps) - prefix // ps) * ps
            if need > alloc.size:
                return None
            self.tree.evict(need - alloc.available_size())
            slots = alloc.alloc_extend([prefix], [total], [last])
        return slots

    def _load_back(self, req: Req) -> None:
        """Bring a host hit beyond the device match back (``kvjax.serve.host_tier``'s rule)."""
        tree = self.tree
        prompt = np.asarray(req.origin_input_ids)
        n = int(prompt.shape[0]) - 1
        if not tree.host_only_count or n <= 0:
            return
        match = tree.match_prefix(prompt[:n])
        if getattr(match, "host_hit_length", 0) < max(tree.host.load_back_threshold, 1):
            return
        ps = self.page_size
        rest = req.seqlen() - match.prefix_len - match.host_hit_length
        quota = self.allocator.available_size() + tree.evictable_size() - (-(-max(rest, 0) // ps) + 1) * ps
        loaded = tree.init_load_back(match, mem_quota=quota)
        if loaded.prefix_len <= req.cache_protected_len:
            return
        lock = tree.inc_lock_ref(loaded.last_node)
        tree.dec_lock_ref(req.lock_receipt if req.lock_receipt is not None else req.last_node)
        self.loads += 1
        req.lock_receipt = lock
        req.last_node = loaded.last_node
        req.prefix_indices = loaded.indices
        req.cache_protected_len = loaded.prefix_len

    @property
    def evicted_tokens(self) -> int:
        """Device tokens evicted so far (with a host tier: demoted or dropped)."""
        return int(self.tree.stats.evicted_tokens)

    @property
    def evicted_nodes(self) -> int:
        """Tree nodes evicted from the device so far."""
        return int(self.tree.stats.num_evictions)
