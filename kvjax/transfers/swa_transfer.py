"""`SWAPageTransferEngine`: the host tier's copies for a hybrid sliding-window pool.

An ``SWAKVPool`` holds two device pools: ``full`` (full-attention layers, indexed by the full
slot ids the tree holds) and ``swa`` (sliding layers, indexed by the SWA slot each full slot is
paired with: ``SWATokenToKVPoolAllocator.full_to_swa_index_mapping``). Its host tier has two host
pools with the same host slot ids (SGLang builds one host pool per device pool): host slot ``h``
holds a token's full-layer rows in the full host pool and its sliding-layer rows in the SWA host
pool.

* backup ``(full slots, host slots)``: the full layers of every slot; the sliding layers of the
  slots paired with an SWA slot now (whole pages: SWA slots are freed by page). Unpaired slots'
  SWA host rows are left as they are (the tree knows which host copies carry SWA).
* load ``(host slots, full slots)``: the full layers of every slot; the sliding layers of the
  slots the caller paired with an SWA slot (the tree unpairs those whose SWA it does not restore
  before the load starts).

Each half is a :class:`~kvjax.transfers.transfer.PageTransferEngine` over one part of the pool (same
staging, same asynchrony, same device-state rule: loads are recorded as pending device updates of
``"swa.full"`` / ``"swa.swa"`` for the owner of the step to apply, backups read the pools the owner
last handed in); a transfer is DONE when both halves are, FAILED when either failed. Under DP
attention each rank's pair is made of the rank's page engines (``page_engine``:
``kvjax.dp.rank_transfer.RankPageTransferEngine`` over the part's slice of the stacked pool, the
rank's own host pools and allocator), so each half reads and writes only the rank's slice.

A draft model's pool (``"kv_draft"``, indexed by the full slots: ``kvjax.plan.draft``) rides with
the full half (:meth:`SWAPageTransferEngine.pair_token_pages`, ``kvjax.transfers.draft_pools``):
its pages are copied at the full slots and host slots of every transfer, whether the sliding side
of those slots is copied or not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.device_updates import PendingDeviceUpdates
from kvjax.plan.kinds.swa import POOL as SWA_POOL
from kvjax.plan.kinds.swa import SWA_HOST_POOL_NAME
from kvjax.tiers.copy_engine import CopyError, TransferStatus
from kvjax.tiers.host_pool import HostKVPool
from kvjax.transfers.transfer import PageTransferEngine

if TYPE_CHECKING:
    from kvjax.transfers.transfer_engines import PageEngineFactory, TransferContext

__all__ = ["SWAPageTransferEngine"]


@dataclass
class _Pair:
    full: Any  # None for a pool without full layers (a pipeline stage of sliding layers only)
    swa: Any  # None when no slot of the transfer had SWA to copy


class SWAPageTransferEngine:
    """A :class:`~kvjax.tiers.copy_engine.CopyEngine` over an ``SWAKVPool`` and its two host pools.

    Args:
        pending: the cache's pending device updates (``KVCache.pending``; see
            :class:`~kvjax.transfers.transfer.PageTransferEngine`).
        full_host: the full layers' host pool; ``None`` for an ``SWAKVPool`` without full layers
            (a pipeline stage of sliding layers only, ``kvjax.serve.pipeline_cache``): only the
            sliding side is copied, with the host slots the tree gives (another stage's full
            layers' host slots).
        swa_host: the sliding layers' host pool (as many slots as ``full_host``).
        allocator: the ``SWATokenToKVPoolAllocator`` whose mapping pairs full and SWA slots.
        pool_name: the ``SWAKVPool`` in the pools (``"swa"``).
        staging: as for :class:`PageTransferEngine`.
        page_engine: makes each half's engine (``PageTransferEngine``'s arguments with ``part``);
            ``None``: ``PageTransferEngine`` over the cache's own pools (module docstring).
    """

    def __init__(
        self,
        pending: PendingDeviceUpdates,
        full_host: HostKVPool | None,
        swa_host: HostKVPool,
        allocator: Any,
        pool_name: str = "swa",
        staging: str = "auto",
        *,
        page_engine: PageEngineFactory | None = None,
    ) -> None:
        if full_host is not None and swa_host.size != full_host.size:
            raise ValueError(f"SWA host pool of {swa_host.size} slots for a full host pool of {full_host.size}")
        if (pending.owner_pools[pool_name].full is None) != (full_host is None):
            raise ValueError("a pure sliding-window pool has no host tier (SGLang builds none for it)")
        make: PageEngineFactory = page_engine if page_engine is not None else PageTransferEngine
        self.full = None if full_host is None else make(pending, full_host, pool_name, staging, part="full")
        self.swa = make(pending, swa_host, pool_name, staging, part="swa")
        self.allocator = allocator
        self.staging = self.swa.staging

    @property
    def engines(self) -> tuple[Any, ...]:
        """The page engines this pair copies through (the full half, if any, then the sliding one)."""
        return (self.swa,) if self.full is None else (self.full, self.swa)

    def pair_token_pages(self, pair: Callable[[Any], Any]) -> SWAPageTransferEngine:
        """A copy of this engine whose full half is ``pair(full half)`` (the allocator's slots
        are the full slots; ``kvjax.transfers.draft_pools.TokenPagesComposition``).
        ``NotImplementedError`` for an engine without a full half (a pipeline stage of sliding
        layers only: a draft runs on the last stage, and speculative decoding over pipeline stages
        is refused before this)."""
        if self.full is None:
            raise NotImplementedError("a draft model's host pool beside a pipeline stage of sliding layers only")
        new = copy.copy(self)
        new.full = pair(self.full)
        return new

    def _paired(self, device_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        swa = self.allocator.full_to_swa_index_mapping[np.asarray(device_slots, dtype=np.int64)]
        live = swa > 0
        return swa[live], live

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> _Pair:
        swa_slots, live = self._paired(device_slots)
        full = None if self.full is None else self.full.start_backup(device_slots, host_slots)
        try:
            swa = self.swa.start_backup(swa_slots, np.asarray(host_slots)[live]) if swa_slots.size else None
        except Exception:
            if self.full is not None:
                self.full.cancel(full)
            raise
        return _Pair(full, swa)

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> _Pair:
        swa_slots, live = self._paired(device_slots)
        try:
            self.swa.host_pool.pages_of(np.asarray(host_slots)[live])
        except Exception as e:
            raise CopyError(f"load cannot start: {e}") from e
        full = None if self.full is None else self.full.start_load(host_slots, device_slots)
        swa = self.swa.start_load(np.asarray(host_slots)[live], swa_slots) if swa_slots.size else None
        return _Pair(full, swa)

    def poll(self, handle: _Pair, wait: bool = False) -> TransferStatus:
        states = [] if self.full is None else [self.full.poll(handle.full, wait)]
        if handle.swa is not None:
            states.append(self.swa.poll(handle.swa, wait))
        if TransferStatus.PENDING in states:
            return TransferStatus.PENDING
        return TransferStatus.FAILED if TransferStatus.FAILED in states else TransferStatus.DONE

    def cancel(self, handle: _Pair) -> None:
        if self.full is not None:
            self.full.cancel(handle.full)
        if handle.swa is not None:
            self.swa.cancel(handle.swa)


def transfer_engine(context: TransferContext) -> SWAPageTransferEngine | None:
    """The engine moving both sides' pages, when the host tier has the sliding side's pool
    (``"host_kv_swa"``); the sliding side's alone for an ``SWAKVPool`` without full layers (a
    pipeline stage of sliding layers only, whose host pool ``"host_kv"`` holds those layers);
    None otherwise (the plain engine)."""
    swa_host_pool = context.host_pools.get(SWA_HOST_POOL_NAME)
    if swa_host_pool is None:
        pools = context.pending.owner_pools
        if SWA_POOL.name in pools.names and pools[SWA_POOL.name].full is None:
            return SWAPageTransferEngine(
                context.pending,
                None,
                context.host_pool,
                context.allocator,
                pool_name=SWA_POOL.name,
                page_engine=context.page_engine,
            )
        return None
    return SWAPageTransferEngine(
        context.pending,
        context.host_pool,
        swa_host_pool,
        context.allocator,
        pool_name=SWA_POOL.name,
        page_engine=context.page_engine,
    )
