"""`MambaRadixCache`: the prefix cache of hybrid recurrent-state models (SGLang's
``MambaRadixCache``; in 0.5.23 ``UnifiedRadixCache`` with the FULL and MAMBA components).

The FULL component caches the attention layers' KV as in :class:`RadixCache`; the
:class:`~kvjax.radix.mamba_component.MambaComponent` keeps recurrent-state checkpoints on nodes
(its module docstring lists the rules). A prefix is reusable only up to the deepest checkpoint on
its path: ``match_prefix`` ends there and reports the FULL-only length as ``full_kv_hit_length``.

Standalone, for simulation::

    tree = MambaRadixCache(page_size=1, mamba_pool_size=20)   # or allocator=..., a state allocator
    slot = int(tree.mamba_allocator.alloc(1)[0])
    r = tree.insert([1, 2, 3], mamba_value=slot)   # r.prefix_len, r.mamba_exist
    m = tree.match_prefix([1, 2, 3, 4])            # m.prefix_len, m.extras["mamba"].slot
    tree.evict(num_tokens=0, mamba_num=1)          # .num_tokens_evicted, .mamba_num_evicted

**Request lifecycle with a built cache** (a ``HybridReqToTokenPool`` as ``req_to_token_pool``):

* :meth:`match_and_lock` (``cow_mamba``, default True) forks the matched checkpoint into the
  request's state slot (allocated here if the request has none, evicting one state if needed):
  ``req.mamba_cow_src_index`` is set and the copy ``(checkpoint, request slot)`` is queued.
* :meth:`cache_unfinished_req` donates a checkpoint of the request's current state: a new slot
  (evicting one state if needed) that the request's state is copied into (queued), or with the
  extra buffer its ping-pong slot with the last tracked state (no copy); the cacheable length is
  then that state's length. :meth:`cache_finished_req` donates the request's own slot (the tracked
  ping-pong slot with the extra buffer) and frees the rest. Whatever the tree does not take
  (a checkpoint already there) is freed.
* Device copies are not done by the tree (it owns no device state): the caller applies
  :meth:`take_state_copies` to the recurrent pool (``kvjax.pools.recurrent.apply_state_copies``)
  before the next forward, in order.

**Where to checkpoint** (``checkpoint_policy``, ``kvjax.radix.checkpoint_policy``): SGLang donates a
checkpoint at every ``cache_unfinished_req`` (each prefill chunk, each decode checkpoint) and at the
finish; a policy may skip some. A skipped point still caches its KV, without a state: the prefix
up to it is reusable only through a deeper checkpoint. This is a kvjax extension (SGLang requires a
``mamba_value`` on every insert); standalone ``insert`` likewise accepts ``mamba_value=None``.

Differences from SGLang: ``evict`` returns an ``int`` (FULL tokens, for callers of the plain tree)
that also carries both counts; ``insert`` returns :class:`MambaInsertResult`; a donated slot that is
already a checkpoint in the tree, or not live, is refused before anything changes
(``InvalidSlotError``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.alloc.state_slots import StateSlotAllocator
from kvjax.errors import InvalidSlotError, OutOfMemoryError
from kvjax.radix.eviction import EvictionPolicy
from kvjax.radix.insert_result import InsertResult
from kvjax.radix.mamba_component import MambaComponent, MambaMatch
from kvjax.radix.match import MatchResult
from kvjax.radix.radix_cache import RadixCache, one_token_allocator

if TYPE_CHECKING:
    from kvjax.hybrid_req_pool import HybridReqToTokenPool
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol
    from kvjax.radix.events import EventSink
    from kvjax.radix.host_component import HostTierComponent
    from kvjax.radix.storage_link import StorageOptions
    from kvjax.request import Req

__all__ = ["CheckpointPolicy", "MambaEvictResult", "MambaInsertResult", "MambaRadixCache"]

#: ``policy(req, cache_len, is_finished) -> bool``: donate a checkpoint at this caching point?
CheckpointPolicy = Callable[[Any, int, bool], bool]


class MambaInsertResult(InsertResult):
    """``insert``'s result: ``prefix_len``, ``last_node``, ``results`` and ``mamba_exist`` (the end
    node already had a checkpoint, so the donated slot was not taken: the caller frees it)."""

    @property
    def mamba_exist(self) -> bool:
        return self.results.get("mamba") is not None


class MambaEvictResult(int):
    """The FULL tokens evicted (the ``int`` value, what plain-tree callers read), with SGLang's
    ``EvictResult`` fields: ``num_tokens_evicted`` and ``mamba_num_evicted`` (cascades included)."""

    num_tokens_evicted: int
    mamba_num_evicted: int

    def __new__(cls, num_tokens_evicted: int, mamba_num_evicted: int) -> MambaEvictResult:
        obj = super().__new__(cls, num_tokens_evicted)
        obj.num_tokens_evicted = int(num_tokens_evicted)
        obj.mamba_num_evicted = int(mamba_num_evicted)
        return obj

    def __repr__(self) -> str:
        return (
            f"MambaEvictResult(num_tokens_evicted={self.num_tokens_evicted}, "
            f"mamba_num_evicted={self.mamba_num_evicted})"
        )


class MambaRadixCache(RadixCache):
    """Radix prefix cache over full-attention KV plus recurrent-state checkpoints.

    Args:
        page_size: tokens per page (> 1 needs ``enable_mamba_extra_buffer``: ``ConfigError``).
        eviction_policy: FULL's eviction policy (checkpoints are evicted least recently used).
        allocator / token_to_kv_pool_allocator: the token allocator (None: simulation).
        mamba_pool_size: the state slots: a count (a new ``StateSlotAllocator``), an existing
            state allocator, or None (taken from ``req_to_token_pool`` when it is a
            ``HybridReqToTokenPool``; otherwise the tree frees no state slots).
        mamba_max_states_per_path: checkpoints kept per path after an insert (-1: no cap).
        enable_mamba_extra_buffer: the request table tracks states in ping-pong slots.
        mamba_cache_chunk_size: the checkpoint grid of ``branching_seqlen`` (default: page size).
        checkpoint_policy: where the lifecycle donates checkpoints (default: everywhere, SGLang).
        req_to_token_pool, disable, enable_kv_cache_events, event_sink, enable_metrics,
        hash_seed, eviction_policy_config: as for :class:`RadixCache`.
        host, storage: the host tier and the storage tier behind it (given by
            :class:`~kvjax.radix.himamba_radix_cache.HiMambaRadixCache`; None: none).
    """

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        *,
        allocator: AllocatorProtocol | None = None,
        token_to_kv_pool_allocator: AllocatorProtocol | None = None,
        mamba_pool_size: int | StateSlotAllocator | None = None,
        mamba_max_states_per_path: int = -1,
        enable_mamba_extra_buffer: bool = False,
        mamba_cache_chunk_size: int | None = None,
        checkpoint_policy: CheckpointPolicy | None = None,
        req_to_token_pool: ReqToTokenPoolProtocol | None = None,
        disable: bool = False,
        enable_kv_cache_events: bool = False,
        event_sink: EventSink | None = None,
        enable_metrics: bool = False,
        hash_seed: int | bytes | str = 0,
        eviction_policy_config: dict | None = None,
        host: HostTierComponent | None = None,
        storage: StorageOptions | None = None,
    ) -> None:
        token_alloc = one_token_allocator(allocator, token_to_kv_pool_allocator)
        state_alloc: StateSlotAllocator | None
        if isinstance(mamba_pool_size, StateSlotAllocator):
            state_alloc = mamba_pool_size
        elif mamba_pool_size is not None:
            state_alloc = StateSlotAllocator(mamba_pool_size)
        else:
            state_alloc = getattr(req_to_token_pool, "mamba_allocator", None)
        component = self._make_component(
            state_alloc,
            page_size=page_size,
            enable_mamba_extra_buffer=enable_mamba_extra_buffer,
            mamba_max_states_per_path=mamba_max_states_per_path,
            mamba_cache_chunk_size=mamba_cache_chunk_size,
        )
        super().__init__(
            page_size,
            eviction_policy,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_alloc,
            disable=disable,
            enable_kv_cache_events=enable_kv_cache_events,
            event_sink=event_sink,
            enable_metrics=enable_metrics,
            hash_seed=hash_seed,
            eviction_policy_config=eviction_policy_config,
            components=(component,),
            host=host,
            storage=storage,
        )
        self.mamba = component
        self.mamba_allocator = state_alloc
        self.enable_mamba_extra_buffer = bool(enable_mamba_extra_buffer)
        self.checkpoint_policy = checkpoint_policy
        self._copies: list[tuple[int, int]] = []

    def _make_component(self, allocator: StateSlotAllocator | None, **options: Any) -> MambaComponent:
        """The MAMBA component over ``allocator`` (a preset with a host tier makes its own)."""
        return MambaComponent(allocator, **options)

    def supports_mamba(self) -> bool:
        return True

    # ------------------------------------------------------------------ match

    def match_prefix(
        self, token_ids: Any, extra_key: Hashable = None, *, req: Req | None = None, cow_mamba: bool = False
    ) -> MatchResult:
        """The longest cached prefix ending at a checkpoint (see :class:`RadixCache`);
        ``result.full_kv_hit_length`` is the FULL-only match, ``result.extras["mamba"]`` a
        :class:`~kvjax.radix.mamba_component.MambaMatch`. With ``cow_mamba`` and ``req``, the
        checkpoint is forked into the request's state slot (:meth:`cow_into_request`)."""
        result = super().match_prefix(token_ids, extra_key)
        if cow_mamba and req is not None:
            self.cow_into_request(req, result)
        return result

    def mamba_match(self, result: MatchResult) -> MambaMatch:
        """``result.extras["mamba"]`` (an empty match for a disabled tree)."""
        got = result.extras.get("mamba")
        return got if isinstance(got, MambaMatch) else MambaMatch(None, None)

    def cow_into_request(self, req: Req, result: MatchResult) -> None:
        """Copy-on-write of the match's checkpoint into ``req.mamba_pool_idx``: allocate the
        request's slot if it has none (evicting one unlocked state if none is free, with the
        matched node locked meanwhile), record ``req.mamba_cow_src_index`` and queue the copy.

        Raises ``OutOfMemoryError`` (nothing changed but the eviction) when no slot can be freed,
        ``ValueError`` for a tree without a state allocator.
        """
        src = self.mamba_match(result).slot
        if src is None:
            req.mamba_cow_src_index = None
            return
        alloc = self._state_allocator("cow_into_request")
        if req.mamba_pool_idx is None:
            got = alloc.alloc(1)
            if got is None:
                receipt = self.inc_lock_ref(result.last_node)
                try:
                    self.evict({"mamba": 1})
                finally:
                    self.dec_lock_ref(receipt)
                got = alloc.alloc(1)
                if got is None:
                    raise OutOfMemoryError(
                        "no recurrent-state slot is free and none can be evicted; raise max_mamba_cache_size "
                        "(or mamba_full_memory_ratio) or run fewer requests"
                    )
            req.mamba_pool_idx = int(got[0])
        else:
            alloc.check_live([req.mamba_pool_idx], f"request {req.rid!r} mamba_pool_idx")
        req.mamba_cow_src_index = src
        self._copies.append((src, int(req.mamba_pool_idx)))

    def match_and_lock(self, req: Req, cow_mamba: bool = True) -> MatchResult:
        """:meth:`RadixCache.match_and_lock`, then (``cow_mamba``) the copy-on-write of the matched
        checkpoint into the request's slot."""
        result = super().match_and_lock(req)
        if cow_mamba and self.mamba_allocator is not None:
            self.cow_into_request(req, result)
        return result

    def queue_state_copy(self, src: int, dst: int) -> None:
        """Queue a device copy ``src -> dst`` behind the tree's own (a caller's fork that must see
        the copies queued before it, e.g. a checkpoint donated in the same step)."""
        self._copies.append((int(src), int(dst)))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The queued device copies ``(src slot, dst slot)``, oldest first; the queue is emptied.
        Apply them in order before the next forward (``apply_state_copies``)."""
        out, self._copies = self._copies, []
        return out

    # ------------------------------------------------------------------ insert

    def _state_allocator(self, what: str) -> StateSlotAllocator:
        if self.mamba_allocator is None:
            raise ValueError(
                f"{what}: this tree has no state allocator; pass mamba_pool_size or a HybridReqToTokenPool"
            )
        return self.mamba_allocator

    def _check_donated(self, slot: Any) -> int:
        """A donated checkpoint slot: one live slot id, not already a checkpoint in the tree."""
        if isinstance(slot, (int, np.integer)) and not isinstance(slot, bool):
            s = int(slot)
        else:
            arr = np.asarray(slot).ravel()
            if arr.size != 1 or arr.dtype.kind not in "iu":
                raise InvalidSlotError(f"mamba_value must be one integer state slot, got {slot!r}")
            s = int(arr[0])
        if s < 1:
            raise InvalidSlotError(f"mamba_value={s}: state slots start at 1 (slot 0 is the padding slot)")
        alloc = self.mamba_allocator
        if alloc is not None and not alloc.is_live_slot(s):
            alloc.check_live([s], "mamba_value")  # raises, naming the slot
        if self.mamba.holds_slot(s):
            raise InvalidSlotError(
                f"mamba_value={s} is already a checkpoint in this tree; donate a slot of your own (fork into a new one)"
            )
        return s

    def insert(  # type: ignore[override]
        self,
        token_ids: Any,
        indices: Any = None,
        extra_key: Hashable = None,
        priority: int = 0,
        *,
        mamba_value: Any = None,
        chunked: bool = False,
        inserted_len: int = 0,
        payloads: Mapping[str, Any] | None = None,
        donate_key: bool = False,
        retention_seconds: float | None = None,
    ) -> MambaInsertResult:
        """Insert ``token_ids`` -> ``indices`` with the checkpoint ``mamba_value`` (the state after
        the key's last page-aligned token) for the end node.

        The end node keeps a checkpoint it already has: ``result.mamba_exist`` is then True and
        the caller frees ``mamba_value``. ``mamba_value=None`` caches the KV without a checkpoint.
        ``donate_key``: as :meth:`RadixCache.insert`.
        Raises (tree unchanged): ``InvalidSlotError`` for a ``mamba_value`` that is not a live slot
        or is already a checkpoint here; otherwise as :meth:`RadixCache.insert`.
        """
        merged = dict(payloads or {})
        if mamba_value is not None:
            merged["mamba"] = self._check_donated(mamba_value)
        matched = super().insert(
            token_ids,
            indices,
            extra_key,
            priority,
            chunked=chunked,
            inserted_len=inserted_len,
            payloads=merged or None,
            donate_key=donate_key,
            retention_seconds=retention_seconds,
        )
        if self.disable:
            return MambaInsertResult(0, self.root, {"mamba": merged.get("mamba")})
        return MambaInsertResult(matched, self.last_insert_node, dict(self._last_insert_results))

    def insert_with(self, *args: Any, **kwargs: Any) -> MambaInsertResult:
        """:meth:`insert` (which already returns the whole result)."""
        return self.insert(*args, **kwargs)

    def attach_checkpoint(self, node: Any, slot: int) -> None:
        """Give an existing node without a checkpoint the checkpoint ``slot`` (e.g. a state the
        model computed for exactly that prefix). Raises (nothing changed) ``ValueError`` when the
        node already has one, ``InvalidSlotError`` for a bad slot."""
        self._check_node(node, "attach_checkpoint")
        self.mamba.attach_checkpoint(node, self._check_donated(slot))

    # ------------------------------------------------------------------ eviction and sizes

    def evict(self, num_tokens: Any = 0, mamba_num: int = 0) -> Any:
        """Evict ``num_tokens`` FULL tokens (least evictable leaves first, their checkpoints with
        them), then ``mamba_num`` checkpoints (least recently used first; a leaf is deleted with
        its KV, an internal node keeps its KV). Returns a :class:`MambaEvictResult` (an ``int``:
        the FULL tokens). ``evict({"full": n, "mamba": k})`` returns the per-component dict."""
        if isinstance(num_tokens, Mapping):
            return super().evict(num_tokens)
        counts = super().evict({"full": int(num_tokens), "mamba": int(mamba_num)})
        return MambaEvictResult(counts["full"], counts["mamba"])

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def mamba_evictable_size(self) -> int:
        return self.mamba.sizes().evictable

    def mamba_protected_size(self) -> int:
        return self.mamba.sizes().protected

    def available_and_evictable_str(self) -> str:
        full = self._full.allocator
        state = self.mamba_allocator
        return (
            f"Available full tokens: {full.available_size() if full is not None else 'n/a'}, "
            f"full evictable: {self.full_evictable_size()}, "
            f"available mamba states: {state.available_size() if state is not None else 'n/a'}, "
            f"mamba evictable: {self.mamba_evictable_size()}"
        )

    # ------------------------------------------------------------------ lifecycle hooks

    def _hybrid_pool(self) -> HybridReqToTokenPool | None:
        pool = self.req_to_token_pool
        return pool if hasattr(pool, "mamba_allocator") and self.mamba_allocator is not None else None  # type: ignore[return-value]

    def _alloc_state_slot(self) -> int:
        """One free state slot, evicting one unlocked checkpoint if none is free."""
        alloc = self._state_allocator("cache_unfinished_req")
        got = alloc.alloc(1)
        if got is None:
            self.evict({"mamba": 1})
            got = alloc.alloc(1)
            if got is None:
                raise OutOfMemoryError(
                    "no recurrent-state slot for a checkpoint and none can be evicted; raise max_mamba_cache_size"
                )
        return int(got[0])

    def prepare_for_caching_req(self, req: Req, key_len: int, is_finished: bool) -> tuple[int, dict[str, Any] | None]:
        pool = self._hybrid_pool()
        if pool is None:
            return key_len, None
        if self.enable_mamba_extra_buffer:
            tracked = req.mamba_last_track_seqlen
            cache_len = 0 if tracked is None else min(int(tracked), key_len)
            cache_len -= cache_len % self.page_size
        else:
            tracked = key_len
            cache_len = key_len
        cpl = req.cache_protected_len
        if cache_len < cpl or tracked is None or cache_len != (tracked - tracked % self.page_size):
            return max(cache_len, cpl), None  # no state for this length: KV only
        policy = self.checkpoint_policy
        if policy is not None and not policy(req, cache_len, is_finished):
            return cache_len, None
        if is_finished:
            if self.enable_mamba_extra_buffer:
                keep = req.mamba_last_track_idx
                pp = req.mamba_ping_pong_track_buffer
                if keep is None or pp is None:
                    return cache_len, None
                return cache_len, {"mamba": int(pp[keep])}
            if req.mamba_pool_idx is None:
                return cache_len, None
            return cache_len, {"mamba": int(req.mamba_pool_idx)}
        new_slot = self._alloc_state_slot()
        if self.enable_mamba_extra_buffer:
            return cache_len, {"mamba": pool.donate_mamba_ping_pong_slot(req, new_slot)}
        if req.mamba_pool_idx is None:
            self._state_allocator("cache_unfinished_req").free([new_slot])
            return cache_len, None
        self._copies.append((int(req.mamba_pool_idx), new_slot))
        return cache_len, {"mamba": new_slot}

    def cleanup_after_caching_req(
        self, req: Req, is_finished: bool, payloads: dict[str, Any] | None, results: dict[str, Any] | None
    ) -> None:
        pool = self._hybrid_pool()
        if pool is None:
            return
        donated = None if payloads is None else payloads.get("mamba")
        taken = donated is not None and results is not None and "mamba" in results and results["mamba"] is None
        if is_finished:
            if self.enable_mamba_extra_buffer:
                pool.free_mamba_cache(req, req.mamba_last_track_idx if taken else None)
            elif taken:
                pool.detach_mamba_slot(req)  # the request's slot is the tree's checkpoint now
            else:
                pool.free_mamba_cache(req)
            return
        if donated is not None and not taken:
            if self._copies and self._copies[-1][1] == donated:
                self._copies.pop()  # the copy into the unused slot is not needed
            self._state_allocator("cache_unfinished_req").free([donated])
        if self.enable_mamba_extra_buffer:
            req.mamba_last_track_seqlen = None
