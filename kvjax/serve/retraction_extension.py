"""`RetractionBackupExtension`: the decode retraction backup in the serving loop (a ``ServingExtension``).

A request retracted during decode (the scheduler's ``_retract``: no room for the running batch's
next tokens) has its KV ``[0, kv_len)`` copied aside before its slots are freed
(``before_release``); when it is admitted again (``after_admit``, after the tree match and any
host load-back), the part past its new tree prefix is copied into fresh pages within the batch's
quota and ``req.kv_committed_len`` is set to the old ``kv_len``, so its prefill starts there
instead of recomputing it. The copy is :class:`~kvjax.transfers.retraction_backup.RetractionBackup`,
in the mode the plan resolved (SGLang's ``resolve_decode_retraction_backup``):

* ``cpu_tensor`` (this module builds it, :func:`retraction_extensions`): the pages of every layer
  copied to numpy (the page gather, then ``device_get``) and written back by the page scatter
  with the pool donated (in place, O(pages)); a pool over a mesh is copied per shard, each
  process keeping and restoring the blocks its own devices hold (``kvjax.transfers.page_copy``:
  across processes nothing is fetched from another process's devices). Attached when the plan
  resolves ``cpu_tensor`` and the backup is active (``plan.decode_retraction_active``: a decode
  server, or the backup set explicitly; SGLang re-prefills retracted requests outside decode
  mode), for pools the page kernels copy (MHA, MLA, a hybrid sliding-window pair), with a
  recurrent-state cache's state slot beside them (``kvjax.serve.recurrent_retraction``: a
  ``RowPart`` restored into the request's new slot); otherwise retracted requests are
  recomputed. With a draft model the draft's pool ``"kv_draft"`` is copied and restored at the
  same slots (``kvjax.transfers.draft_pools.with_draft_pool``), so a restored
  request's draft KV is its own again (an EAGLE draft's hidden-state store is not copied: see
  ``kvjax.serve.speculative.eagle``). Under lockstep DP attention (``in_lockstep``) the copies are the rank's own
  (``kvjax.dp.rank_transfer``: its pages of the stacked pool, written back into its slice only).
* ``host_pool``: the host tier's extension (``host_tier.py``) owns one of these over the host
  tier's pool, so the restore logic lives here once.

Device state: the restore's copy is recorded as a pending device update (``cache.pending``),
applied by the owner of the step before the step that reads the restored tokens (the scheduler
does, right before launching it); the extension never swaps ``cache.pools``.

Fallbacks recompute: no backup (failed copy, full host pool), a tree prefix at re-admission
other than the one the backup covers, or no device room within the quota now (the backup is
kept for a later admission). Units: tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.plan.kinds import planner_kinds_of
from kvjax.serve.extension import ServingExtension
from kvjax.transfers.draft_pools import with_draft_pool
from kvjax.transfers.retraction_backup import CopyPart, RetractionBackup, RowPart
from kvjax.transfers.transfer import PoolRef

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.serve.serving_req import ServingReq
    from kvjax.transfers.page_copy import PageCopy


def _page_copy(pool: Any, slots: np.ndarray) -> PageCopy:
    """``cpu_tensor`` backup: the numpy copy of whole-page ``slots`` of every layer, the blocks
    this process's devices hold (``kvjax.transfers.page_copy``)."""
    from kvjax.transfers.device_pages import page_layers
    from kvjax.transfers.page_copy import copy_pages
    from kvjax.transfers.transfer import device_pages

    layers = page_layers(pool)
    page_size = layers[0].shape[1]
    return copy_pages(layers, device_pages(slots, page_size, layers[0].shape[0] * page_size))


def _page_load(pool: Any, copy: PageCopy, slots: np.ndarray) -> Any:
    """``cpu_tensor`` restore: write :func:`_page_copy`'s copy into whole-page ``slots`` (in place)."""
    from kvjax.transfers.device_pages import page_layers, with_page_layers
    from kvjax.transfers.page_copy import load_pages
    from kvjax.transfers.transfer import device_pages

    layers = page_layers(pool)
    page_size = layers[0].shape[1]
    pages = device_pages(slots, page_size, layers[0].shape[0] * page_size)
    return with_page_layers(pool, load_pages(layers, copy, pages))


def backup_parts(cache: KVCache, kind_parts: Sequence[Any] | None) -> list[CopyPart | RowPart] | None:
    """What a ``cpu_tensor`` backup of ``cache`` copies: ``kind_parts``, what each kind copies of
    its pools (``kvjax.serve.kinds.retraction_parts``: ``"kv"``; a hybrid sliding-window pool's
    full side and the window of its sliding side; a recurrent-state cache's state slot, a
    ``RowPart``; None when a kind's state cannot be backed up),
    then the draft's ``"kv_draft"`` at the request's slots when there is one; ``None`` when a
    kind's state cannot be backed up."""
    if kind_parts is None:
        return None
    return [CopyPart(PoolRef(p)) if isinstance(p, str) else p for p in (*kind_parts, *with_draft_pool((), cache.pools))]


def cpu_tensor_backup(cache: KVCache, kind_parts: Sequence[Any] | None) -> RetractionBackup:
    """A ``cpu_tensor`` :class:`RetractionBackup` of :func:`backup_parts` of ``cache`` through the
    page kernels (``ConfigError`` naming the backup when a kind's state cannot be backed up);
    ``kind_parts``: ``kvjax.serve.kinds.retraction_parts(cache)``."""
    parts = backup_parts(cache, kind_parts)
    if not parts:
        raise ConfigError(
            "disaggregation_decode_retraction_backup",
            "cpu_tensor",
            f"the cpu_tensor backup cannot copy this cache's state ({cache.plan.model}); use host_pool or leave "
            "it unset",
        )
    page_size = cache.token_to_kv_pool_allocator.page_size
    return RetractionBackup(
        "cpu_tensor", page_size, pending=cache.pending, parts=parts, get_copy=_page_copy, load_copy=_page_load
    )


class RetractionBackupExtension(ServingExtension):
    """See the module docstring. ``retraction``: the backups (its ``restored``, ``restored_tokens``,
    ``backed_up`` and ``fallbacks`` count what happened)."""

    def __init__(self, cache: KVCache, retraction: RetractionBackup) -> None:
        self.cache = cache
        self.retraction = retraction
        self.scheduler: Any = None

    def attach(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def poll(self) -> None:
        self.retraction.poll()

    def after_admit(self, req: ServingReq) -> None:
        if req.rid in self.retraction:
            self._restore(req)

    def in_lockstep(self, layout: Any, rank: int, shared: dict[str, Any]) -> bool:
        """Lockstep DP (``kvjax.dp.lockstep``): the ``cpu_tensor`` copies become DP rank ``rank``'s
        (``kvjax.dp.rank_transfer.rank_page_copy`` / ``rank_page_load``: its pages of the stacked
        pool to numpy and back into its slice only, in place; a recurrent state's rows likewise,
        ``kvjax.serve.recurrent_retraction.rank_state_part``). A ``host_pool`` backup copies
        through the host tier's engine: its extension says (``HostTierExtension.in_lockstep``)."""
        if self.retraction.mode != "cpu_tensor":
            return False
        from kvjax.dp.rank_transfer import rank_page_copy, rank_page_load
        from kvjax.serve.recurrent_retraction import rank_state_part

        self.retraction.get_copy = rank_page_copy(rank)
        self.retraction.load_copy = rank_page_load(rank)
        self.retraction.parts = tuple(
            rank_state_part(p, self.cache, layout, rank) if isinstance(p, RowPart) else p for p in self.retraction.parts
        )
        return True

    def restores_pool(self, name: str) -> bool:
        """Whether a restore writes pool ``name`` back: a ``cpu_tensor`` backup copies its
        ``pool_names``; a ``host_pool`` one every pool the host tier's engine pairs
        (``kvjax.transfers.draft_pools.with_draft_transfers``)."""
        return self.retraction.mode != "cpu_tensor" or name in self.retraction.pool_names

    def before_release(self, req: ServingReq, finished: bool) -> None:
        if finished or req.req_pool_idx is None or req.abort_reason is not None:
            self.retraction.discard(req.rid)
            return
        end = req.kv_len()
        row = self.cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        self.retraction.backup(req.rid, row[:end], 0, end, request=req)

    def _restore(self, req: ServingReq) -> None:
        """Bring a retracted request's own KV back when its tree prefix is the one it had."""
        retraction = self.retraction
        kept = retraction.peek(req.rid)
        assert kept is not None
        prefix = req.cache_protected_len
        if prefix >= kept.end or kept.end > req.seqlen() - 1 or req.req_pool_idx is None:
            retraction.discard(req.rid)  # the tree holds it all now, or the request changed
            return
        alloc = self.cache.token_to_kv_pool_allocator
        tree = self.cache.tree_cache
        ps = alloc.page_size
        need = retraction.pages_from(req.rid, prefix) * ps
        reserved = self.scheduler.reserved_tokens if self.scheduler is not None else 0
        rest = (-(-(req.seqlen() - kept.end) // ps) + 1) * ps
        slots = None
        if need <= alloc.available_size() + tree.evictable_size() - reserved - rest:
            if alloc.available_size() < need:
                tree.evict(need - alloc.available_size())
            slots = alloc.alloc(need)
        if slots is None:
            # No room now: keep the backup for a later admission (this one will likely not fit
            # either; if it does, the request recomputes and its release replaces the backup).
            return
        if not retraction.restore(req.rid, slots, prefix, request=req):
            alloc.free(slots)
            return
        self.cache.req_to_token_pool.write(req.req_pool_idx, prefix, slots[: kept.end - prefix])
        req.kv_committed_len = kept.end


def retraction_extensions(cache: KVCache, kind_parts: Sequence[Any] | None) -> list[ServingExtension]:
    """The ``cpu_tensor`` retraction extension where the plan asks for it and the pool allows it
    (see the module docstring), else none (``host_pool`` comes with the host tier's extension);
    ``kind_parts``: what each kind copies (``kvjax.serve.kinds.retraction_parts``, which passes
    them: the kinds' registry sits above this module)."""
    plan = cache.plan
    if plan.decode_retraction_backup != "cpu_tensor" or not plan.decode_retraction_active:
        return []
    backup = copyable_backup(cache, kind_parts)
    return [] if backup is None else [RetractionBackupExtension(cache, backup)]


def copyable_backup(cache: KVCache, kind_parts: Sequence[Any] | None) -> RetractionBackup | None:
    """:func:`cpu_tensor_backup` of ``cache`` where every kind keeps its state in pages (or rows)
    the backup copies and the page kernels read every pool it names, else ``None`` (retracted
    requests recompute); ``kind_parts`` as for :func:`cpu_tensor_backup`."""
    # Every kind of the cache must keep its state in pages the backup copies.
    if not all(kind.page_backup for kind in planner_kinds_of(cache.plan)):
        return None
    parts = backup_parts(cache, kind_parts)
    if not parts:
        return None
    from kvjax.transfers.device_pages import page_layers

    try:
        for part in parts:
            if not isinstance(part, RowPart):  # a row part copies through its own functions
                page_layers(part.ref.get(cache.pools))
    except (NotImplementedError, KeyError):
        return None
    return cpu_tensor_backup(cache, kind_parts)
