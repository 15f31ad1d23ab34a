"""`RetractionBackup`: a retracted request's own KV kept aside and restored when it resumes
(SGLang's decode retraction backup), instead of recomputed.

A request retracted during decode holds KV for tokens ``[0, kv_len)`` on whole pages (the prefix
``[0, cache_protected_len)`` on the tree's, the rest on its own). All of it is copied out before the
request's slots are freed (the tree's part may be evicted before the request resumes), and when
the request is admitted again, the part past its new tree prefix is copied into fresh pages; its
prefill then starts at ``kv_len``.

Modes (the plan's ``decode_retraction_backup``):

* ``host_pool``: the pages go to the host tier's pool (slots *held* outside the tree,
  ``HostTierComponent.alloc_held``; host eviction makes room) through the copy
  engine, asynchronously; a restore waits for that backup. A host pool that cannot make room
  skips the backup (SGLang aborts the request there; kvjax recomputes it). The restore's load
  may read the held slots in place until it lands, so they are freed by :meth:`poll` once it has
  (at once when it already has).
* ``cpu_tensor``: ``get_cpu_copy`` / ``load_cpu_copy`` of the device pool (numpy copies), or the
  ``get_copy`` / ``load_copy`` functions given (the serving extension's page copies, in place). A
  copy is a list of per-layer numpy arrays ``[tokens, ...]`` or a
  :class:`~kvjax.transfers.page_copy.PageCopy` (the blocks this process holds); a restore from a
  later token writes its :func:`copy_tail`. Every :class:`CopyPart` of ``parts`` is copied: a
  pool at the request's slots (with a draft model the target's ``"kv"`` and the draft's
  ``"kv_draft"``, ``kvjax.transfers.draft_pools.with_draft_pool``: one slot id addresses a token
  in both, so a restored request's draft KV is back with its target KV), or a pool indexed by
  slots the request's slots map to, over the request's last positions only (a hybrid
  sliding-window pool's sliding side: the slots paired with the request's, over its window).
  (``host_pool`` copies through the host tier's engine, which pairs the pools it copies.)
  A :class:`RowPart` is a pool indexed by rows the request holds rather than by its token slots
  (a recurrent-state cache's state slot): its rows are copied whole at the backup (as they are
  after token ``end``) and written at the restore into the rows the request holds then, whatever
  its new tree prefix (the request resumes at ``end``, so no earlier state is of use).

Device state (``docs/architecture.md``, "Device state: who changes it"): a restore never swaps
the caller's pools. ``host_pool``: the copy engine records the load. ``cpu_tensor``: the copy aside
reads the pools the owner last handed in (``PendingDeviceUpdates.read``) and the restore records
the write-back as a pending device update; either lands when the owner of the step applies the
pending updates (``pools = cache.apply_pending(pools)``), before the step that reads the restored
tokens.

Every fallback recomputes: a backup that failed, a resume whose tree prefix differs from the one
at retraction, or no device room within the admission's quota. Units: tokens and slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvjax.device_updates import DeviceUpdate, PendingDeviceUpdates
from kvjax.tiers.copy_engine import CopyError, TransferStatus
from kvjax.transfers.page_copy import PageCopy
from kvjax.transfers.transfer import PoolRef

RETRACTION_BACKUPS = ("host_pool", "cpu_tensor")


def copy_tail(copy: Any, tokens: int) -> Any:
    """A ``cpu_tensor`` copy of its tokens from ``tokens`` (page-aligned) on: a :class:`PageCopy`'s
    ``tail``, or each per-layer array of a list sliced."""
    if isinstance(copy, PageCopy):
        return copy.tail(tokens)
    return [c[tokens:] for c in copy]


@dataclass
class RetractedKV:
    """What was kept of one retracted request: tokens ``[start, end)`` on ``num_pages`` pages."""

    start: int
    end: int
    num_pages: int
    host_slots: np.ndarray | None = None
    handle: Any = None
    cpu_copy: dict[str, tuple[int, Any]] | None = None  # cpu_tensor: by part, (its first token, its copy)


@dataclass(frozen=True)
class CopyPart:
    """One device pool (or part of one) a ``cpu_tensor`` backup copies.

    Attributes:
        ref: where its page arrays live in the pools (``PoolRef("kv")``, ``PoolRef("swa", "swa")``).
        window: tokens: only the request's positions from ``page_floor(end - window)`` on are
            copied (and restored); ``None``: all of them.
        translate: ``translate(request slots) -> this pool's slots`` (whole pages to whole pages;
            a slot it maps to 0 has nothing to copy, and the backup is not taken); ``None``: the
            request's slots themselves. Read at the backup and again at the restore (fresh slots).
    """

    ref: PoolRef
    window: int | None = None
    translate: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def target(self) -> str:
        """The name its pending updates and reads use (``"kv"``, ``"swa.swa"``)."""
        return self.ref.target

    def first_token(self, start: int, end: int, page_size: int) -> int:
        """The first token of ``[start, end)`` it copies (page aligned)."""
        if self.window is None:
            return start
        return max(start, max(0, end - self.window) // page_size * page_size)

    def slots(self, request_slots: np.ndarray) -> np.ndarray:
        """Its slots of whole-page ``request_slots``."""
        return request_slots if self.translate is None else np.asarray(self.translate(request_slots)).astype(np.int32)


@dataclass(frozen=True)
class RowPart:
    """A device pool indexed by rows the request holds, not by its token slots, that a
    ``cpu_tensor`` backup copies whole (a recurrent-state pool at the request's state slot).

    Attributes:
        ref: where its arrays live in the pools (``PoolRef("recurrent")``).
        rows: ``rows(request) -> row ids`` (``None`` or empty: the request holds none, and the
            backup is not taken or, at the restore, the request recomputes). Read at the backup
            and again at the restore (the rows it holds then).
        get_copy: ``get_copy(pool, rows) -> copy`` (numpy, O(rows)).
        load_copy: ``load_copy(pool, copy, rows) -> new pool`` (the pool's arrays donated: in place).
        before_restore: called before the restore's write is recorded, to record first what was
            queued elsewhere for the same rows and must land before it (``None``: nothing).
    """

    ref: PoolRef
    rows: Callable[[Any], np.ndarray | None]
    get_copy: Callable[[Any, np.ndarray], Any]
    load_copy: Callable[[Any, Any, np.ndarray], Any]
    before_restore: Callable[[], None] | None = None

    @property
    def target(self) -> str:
        """The name its pending updates and reads use (``"recurrent"``); the rows are its "pages"."""
        return self.ref.target

    def rows_of(self, request: Any) -> np.ndarray | None:
        """The request's rows (int64), or ``None`` when it holds none (or no request is given)."""
        found = None if request is None else self.rows(request)
        if found is None:
            return None
        rows = np.asarray(found, np.int64).reshape(-1)
        return rows if rows.size and rows.min() > 0 else None


class RetractionBackup:
    """Backups of retracted requests, by request id (see the module docstring).

    Args:
        mode: ``"host_pool"`` or ``"cpu_tensor"``.
        page_size: the device pool's page size.
        host: the host tier's component (``host_pool``): its host slots and copy engine.
        pending: the cache's pending device updates (``cpu_tensor``; ``KVCache.pending``): the
            copy aside reads through it, the restore records into it.
        parts: what is copied (``cpu_tensor``): :class:`CopyPart` s, or pool names for pools copied
            at the request's slots (default the ``"kv"`` pool), and :class:`RowPart` s (copied
            through their own functions, at the rows the request given to :meth:`backup` and
            :meth:`restore` holds).
        get_copy: ``get_copy(pool, device_slots) -> copy`` (a list of per-layer numpy
            ``[tokens, ...]`` or a ``PageCopy``; ``cpu_tensor``; default the pool's ``get_cpu_copy``).
        load_copy: ``load_copy(pool, copy, device_slots) -> new pool`` (``cpu_tensor``; default
            the pool's ``load_cpu_copy``).

    ``restored`` counts the requests restored (not recomputed), ``restored_tokens`` their tokens.
    """

    def __init__(
        self,
        mode: str,
        page_size: int,
        *,
        host: Any = None,
        pending: PendingDeviceUpdates | None = None,
        parts: Sequence[CopyPart | RowPart | str] = ("kv",),
        get_copy: Callable[[Any, np.ndarray], Any] | None = None,
        load_copy: Callable[[Any, Any, np.ndarray], Any] | None = None,
    ):
        if mode not in RETRACTION_BACKUPS:
            raise ValueError(f"decode_retraction_backup={mode!r}: use one of {', '.join(RETRACTION_BACKUPS)}")
        if mode == "host_pool" and host is None:
            raise ValueError("the host_pool retraction backup needs the host tier")
        if mode == "cpu_tensor" and pending is None:
            raise ValueError("the cpu_tensor retraction backup needs the cache's pending device updates: cache.pending")
        self.mode = mode
        self.page_size = int(page_size)
        self.host = host
        self.pending = pending
        self.parts = tuple(CopyPart(PoolRef(p)) if isinstance(p, str) else p for p in parts)
        self.get_copy = get_copy or (lambda pool, slots: pool.get_cpu_copy(slots))
        self.load_copy = load_copy or (lambda pool, copy, slots: pool.load_cpu_copy(copy, slots))
        self._kept: dict[Any, RetractedKV] = {}
        self._releasing: list[tuple[Any, np.ndarray]] = []  # (restore's load, its held host slots)
        self.backed_up = 0
        self.restored = 0
        self.restored_tokens = 0
        self.fallbacks = 0

    def __contains__(self, key: Any) -> bool:
        return key in self._kept

    @property
    def held(self) -> int:
        """Requests with a backup."""
        return len(self._kept)

    def _pages(self, slots: np.ndarray) -> np.ndarray:
        ps = self.page_size
        pages = np.asarray(slots, np.int64) // ps
        _, first = np.unique(pages, return_index=True)
        return pages[np.sort(first)]

    def _expand(self, pages: np.ndarray) -> np.ndarray:
        ps = self.page_size
        return (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1).astype(np.int32)

    def backup(self, key: Any, slots: np.ndarray, start: int, end: int, request: Any = None) -> bool:
        """Keep the KV of tokens ``[start, end)`` whose device slots are ``slots`` (the request's
        own pages; ``start`` page-aligned), and the rows of each :class:`RowPart` ``request``
        holds. Starts the copy now, before the slots are freed. Returns whether a backup was taken."""
        self.discard(key)
        if end <= start or start % self.page_size:
            return False
        pages = self._pages(slots)
        device_slots = self._expand(pages)
        kept = RetractedKV(start, end, int(pages.size))
        if self.mode == "host_pool":
            host_slots = self.host.alloc_held(int(device_slots.size))
            if host_slots is None:
                self.fallbacks += 1
                return False
            try:
                kept.handle = self.host.engine.start_backup(device_slots, host_slots)
            except CopyError:
                self.host.free_held(host_slots)
                self.fallbacks += 1
                return False
            kept.host_slots = host_slots
        else:
            assert self.pending is not None
            kept.cpu_copy = {}
            for part in self.parts:
                if isinstance(part, RowPart):
                    rows = part.rows_of(request)
                    if rows is None:  # the request holds no rows to copy: no backup
                        self.fallbacks += 1
                        return False
                    pool = part.ref.get(self.pending.read(part.target, rows))
                    kept.cpu_copy[part.target] = (end, part.get_copy(pool, rows))
                    continue
                first = part.first_token(start, end, self.page_size)
                slots_of_part = part.slots(device_slots[first - start :])
                if part.translate is not None and (not slots_of_part.size or slots_of_part.min() <= 0):
                    # a position the translation maps nowhere has nothing to copy: no backup
                    self.fallbacks += 1
                    return False
                part_pages = self._pages(slots_of_part)
                pool = part.ref.get(self.pending.read(part.target, part_pages))
                kept.cpu_copy[part.target] = (first, self.get_copy(pool, slots_of_part))
        self._kept[key] = kept
        self.backed_up += 1
        return True

    def peek(self, key: Any) -> RetractedKV | None:
        return self._kept.get(key)

    def pages_from(self, key: Any, token: int) -> int:
        """Pages of the backup of ``key`` from token ``token`` (page-aligned, >= its start) on."""
        kept = self._kept[key]
        return kept.num_pages - (token - kept.start) // self.page_size

    def restore(self, key: Any, device_slots: np.ndarray, from_token: int | None = None, request: Any = None) -> bool:
        """Copy the backup of ``key``, from token ``from_token`` (page-aligned; default its start)
        on, into ``device_slots`` (whole fresh pages, :meth:`pages_from` of them), and each
        :class:`RowPart`'s rows into those ``request`` holds now, and drop it. Returns False
        (backup dropped, nothing recorded: recompute) when its copy failed or ``request`` holds
        no rows of a :class:`RowPart`."""
        kept = self._kept.pop(key)
        skip = 0 if from_token is None else from_token - kept.start
        ok = True
        if self.mode == "host_pool":
            assert kept.host_slots is not None
            engine = self.host.engine
            load = None
            try:
                ok = engine.poll(kept.handle, wait=True) is TransferStatus.DONE
                if ok:
                    load = engine.start_load(kept.host_slots[skip:], device_slots)
            except CopyError:
                ok = False
            if load is not None and engine.poll(load) is TransferStatus.PENDING:
                self._releasing.append((load, kept.host_slots))
            else:
                self.host.free_held(kept.host_slots)
        else:
            assert kept.cpu_copy is not None and self.pending is not None
            begin = kept.start + skip
            rows_now = {p.target: p.rows_of(request) for p in self.parts if isinstance(p, RowPart)}
            ok = all(rows is not None for rows in rows_now.values())
            for part in self.parts if ok else ():
                if isinstance(part, RowPart):
                    rows = rows_now[part.target]
                    assert rows is not None
                    if part.before_restore is not None:
                        part.before_restore()
                    self.pending.record(self._rows_update(part, kept.cpu_copy[part.target][1], rows))
                    continue
                first, copy = kept.cpu_copy[part.target]
                at = max(first, begin)
                slots_of_part = part.slots(np.asarray(device_slots)[at - begin :])
                self.pending.record(self._restore_update(part.ref, copy_tail(copy, at - first), slots_of_part))
        if ok:
            self.restored += 1
            self.restored_tokens += kept.end - kept.start - skip
        else:
            self.fallbacks += 1
        return ok

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools (or parts, ``"swa.swa"``) the ``cpu_tensor`` copies write back."""
        return tuple(part.target for part in self.parts)

    def _restore_update(self, ref: PoolRef, copy: Any, device_slots: np.ndarray) -> DeviceUpdate:
        """``cpu_tensor``: the write of ``copy`` into ``device_slots`` of ``ref``, as a pending device update."""
        load_copy = self.load_copy
        slots = np.asarray(device_slots).copy()

        def write(pools: Any) -> Any:
            return ref.put(pools, load_copy(ref.get(pools), copy, slots))

        return DeviceUpdate("retraction restore", ref.target, self._pages(slots), write)

    @staticmethod
    def _rows_update(part: RowPart, copy: Any, rows: np.ndarray) -> DeviceUpdate:
        """``cpu_tensor``: the write of a :class:`RowPart`'s ``copy`` into ``rows``, as a pending device update."""
        load_copy = part.load_copy
        rows = rows.copy()

        def write(pools: Any) -> Any:
            return part.ref.put(pools, load_copy(part.ref.get(pools), copy, rows))

        return DeviceUpdate("retraction restore", part.target, rows, write)

    def poll(self, wait: bool = False) -> int:
        """Free the held host slots of restores whose loads landed (all, waiting, with ``wait``);
        returns the host slots freed. The serving loop calls it at its polling step."""
        still = []
        freed = 0
        for load, slots in self._releasing:
            if self.host.engine.poll(load, wait) is TransferStatus.PENDING:
                still.append((load, slots))
                continue
            self.host.free_held(slots)
            freed += int(slots.size)
        self._releasing = still
        return freed

    def discard(self, key: Any) -> None:
        """Drop the backup of ``key`` (if any), returning its host slots."""
        kept = self._kept.pop(key, None)
        if kept is not None and kept.host_slots is not None:
            self.host.engine.cancel(kept.handle)
            self.host.engine.poll(kept.handle, wait=True)
            self.host.free_held(kept.host_slots)
