"""The draft model's pools in the host tier: its host pool copied with the target's, page for page.

SGLang (``maybe_register_hicache_draft``, the legacy path) builds the draft model's host pool with
the same slot count as the target's host pool, so one host slot id addresses both, and registers
it with the cache controller (``set_draft_kv_pool``): every backup and load of target pages copies
the same pages of the draft pool. kvjax does the same with :class:`PairedCopyEngine`: the tree
drives one engine, which starts a transfer of the draft pool's pages with every transfer of the
target's (same device slots, same host slots; the draft host pool has no allocator of its own in
use: the tree's host allocator is the target host pool's) and reports it DONE only when both
landed, at the same polling step. Accounting is the target's: nothing is allocated twice. The
``cpu_tensor`` retraction backup copies the same way (:func:`with_draft_pool`: the draft's pool
beside the target's, at the same slots).

A kind's composed engine (:class:`TokenPagesComposition`) pairs the draft with the one engine in it
that copies the pages the allocator's token slots index, never with the rest: the sliding-window
pair's full half (the draft's pool is indexed by the full slots, ``kvjax.plan.draft``; the sliding
half's SWA slots index nothing of the draft's), the recurrent kind's KV page engine (the checkpoints'
state slots index nothing of the draft's, and the draft has no state of its own). SGLang 0.5.23
does the same for the draft's full-attention pool: its hybrid pool assembler's ``PoolName.DRAFT``
entry takes its host indices from the target's KV entry (``indices_from_pool=PoolName.KV``),
beside the ``SWA`` / ``MAMBA`` entries copied by their own indices. Where kvjax differs: a
sliding-window draft's sliding layers are in ``"kv_draft"`` too (indexed by the full slots, not
windowed), so they ride with the full pages; SGLang gives them their own pool and host entry
(``PoolName.DRAFT_SWA``, the target's SWA indices, its trailing pages).

Errors: a backup reports FAILED when either copy failed (the tree then drops the host copy and
recomputes, losing nothing). A load that cannot start raises ``CopyError`` with nothing recorded
for the target pool: the draft's load is started first (its scatter recorded as a pending device
update into device slots the caller is about to fill and that hold no live data), then the
target's. Device state changes only when the owner of the step applies the pending updates
(``docs/architecture.md``, "Device state: who changes it").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan.draft import DRAFT_MODEL_ALGORITHMS, DRAFT_POOL_NAME
from kvjax.tiers.copy_engine import CopyEngine, TransferStatus


def check_draft_buildable(plan: Any, config: CacheConfig) -> None:
    """Before anything is allocated: the plan's draft model can be built.

    ``ConfigError`` for STANDALONE without ``draft_spec``; ``NotImplementedError`` naming the
    draft pools of a target kind kvjax does not plan them for (SWA, DSA).
    """
    if config.speculative_algorithm not in DRAFT_MODEL_ALGORITHMS or plan.draft is not None:
        return
    if config.speculative_algorithm == "STANDALONE":
        raise ConfigError(
            "draft_spec",
            None,
            "speculative_algorithm='STANDALONE' needs the draft model: pass draft_spec=ModelSpec(...) of the draft",
        )
    what = "DSA" if plan.is_dsa else repr(plan.kv_pool_kind)
    raise NotImplementedError(
        f"kvjax cannot build the draft model's KV pools for a {what} target yet (speculative_algorithm="
        f"{config.speculative_algorithm!r}, {plan.model}); the plan is available from plan_kv_cache"
    )


@dataclass
class _Paired:
    handles: tuple[Any, ...]
    status: TransferStatus = TransferStatus.PENDING


class PairedCopyEngine:
    """A :class:`~kvjax.tiers.copy_engine.CopyEngine` copying the same slots of several pools.

    ``primary`` copies the target's pool; each of ``followers`` copies another pool whose device
    and host slots index the same tokens (the draft's). A handle is DONE when every copy is DONE,
    FAILED when every copy settled and one FAILED, else PENDING.
    """

    def __init__(self, primary: CopyEngine, *followers: CopyEngine) -> None:
        self.primary = primary
        self.followers = tuple(followers)

    @property
    def engines(self) -> tuple[CopyEngine, ...]:
        return (self.primary, *self.followers)

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> _Paired:
        return _Paired(tuple(e.start_backup(device_slots, host_slots) for e in self.engines))

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> _Paired:
        handles = [f.start_load(host_slots, device_slots) for f in self.followers]
        return _Paired((self.primary.start_load(host_slots, device_slots), *handles))

    def poll(self, handle: _Paired, wait: bool = False) -> TransferStatus:
        if handle.status is not TransferStatus.PENDING:
            return handle.status
        statuses = [e.poll(h, wait) for e, h in zip(self.engines, handle.handles, strict=True)]
        if TransferStatus.PENDING in statuses:
            return TransferStatus.PENDING
        failed = TransferStatus.FAILED in statuses
        handle.status = TransferStatus.FAILED if failed else TransferStatus.DONE
        handle.handles = ()
        return handle.status

    def cancel(self, handle: _Paired) -> None:
        for e, h in zip(self.engines, handle.handles, strict=True):
            e.cancel(h)


def with_draft_pool(pool_names: tuple[str, ...], pools: Any) -> tuple[str, ...]:
    """``pool_names`` (the target's pools a page copy moves), followed by the draft's pool
    ``"kv_draft"`` when ``pools`` holds one: the draft's pages are indexed by the target's slots,
    so a copy of target pages (the ``cpu_tensor`` retraction backup) copies the same pages of the
    draft's, as the host tier's :class:`PairedCopyEngine` does."""
    return (*pool_names, DRAFT_POOL_NAME) if DRAFT_POOL_NAME in pools else tuple(pool_names)


@runtime_checkable
class TokenPagesComposition(Protocol):
    """A kind's host-tier engine composed of several (the sliding-window pair, the recurrent KV
    and state engines) that can pair another engine with the one of them copying the pages the
    allocator's token slots index (the engine whose device and host slots a draft's pool shares)."""

    def pair_token_pages(self, pair: Callable[[Any], Any]) -> Any:
        """A copy of this engine whose token pages' engine ``e`` is ``pair(e)``; the others as they are."""
        ...


def with_draft_transfers(engine: Any, draft_host_pool: Any, page_engine: Any = None) -> Any:
    """``engine`` (the host tier's engine of the target's pools), whose engine over the pages the
    allocator's token slots index (``engine`` itself, or a :class:`TokenPagesComposition`'s part)
    is paired with one over the draft pool ``"kv_draft"`` and ``draft_host_pool`` when there is
    one, recording into the same pending device updates (that engine's ``pending``), so the
    draft's loads are applied with the target's. ``page_engine``: makes the draft's engine (a
    ``TransferContext.page_engine``, e.g. a DP rank's); ``None``: ``PageTransferEngine``.
    ``AssertionError`` when the two host pools differ in size (the plan sizes them alike)."""
    if draft_host_pool is None:
        return engine
    from kvjax.transfers.transfer import PageTransferEngine

    make = page_engine if page_engine is not None else PageTransferEngine

    def pair(pages: Any) -> PairedCopyEngine:
        if draft_host_pool.size != pages.host_pool.size:
            raise AssertionError(
                f"draft host pool of {draft_host_pool.size} slots, target's {pages.host_pool.size}: they must match"
            )
        return PairedCopyEngine(pages, make(pages.pending, draft_host_pool, DRAFT_POOL_NAME, pages.staging))

    if isinstance(engine, TokenPagesComposition):
        return engine.pair_token_pages(pair)
    return pair(engine)
