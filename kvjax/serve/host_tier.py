"""`HostTierExtension`: the host tier (HiCache) in the serving loop (a ``ServingExtension``).

* ``poll`` (once per scheduler step, before the batch): SGLang's ``writing_check`` and
  ``loading_check``; backups and loads that landed unlock their nodes. With several processes
  (the scheduler's ``agreement`` is not local), the host pool's copy engine is wrapped in
  ``kvjax.tiers.agreed_copy_engine.AgreedCopyEngine``: ``poll`` first agrees every pending
  transfer's status with the other processes (MIN, as SGLang), so every tree completes the same
  transfers at the same step; the storage tier's hits and prefetched pages are agreed the same
  way (``kvjax.radix.storage_link``). The step never waits for a
  transfer: backups are gathers (of the pools the scheduler last handed in) whose host copy
  completes in the background, loads are scatters the next step's reads depend on through jax's
  data dependencies. Only when nothing is running and requests wait does ``poll`` wait for the
  transfers in flight (no step to overlap with, and a pending backup's node lock may be what
  keeps the next request out: asynchronous backups, e.g. of a pool sharded over devices).
* ``after_admit`` (the request was matched and locked): when the match has a host hit of at
  least the load-back threshold, the host-only chain is loaded back (all or nothing; it may evict
  device leaves first) and the request's prefix, row and lock move to the loaded node, so its
  prefill starts past it. The scheduler reads the prefix from ``req.prefix_indices`` after the
  hooks. The match is redone here to read the host hit (only while host-only nodes exist), so the
  tree's own match counter counts such admissions twice; the scheduler's cached-token figures
  are not affected. The load's scatter is recorded as a pending device update
  (``cache.pending``) that the scheduler applies right before the prefill step that reads the
  prefix: this extension never swaps ``cache.pools`` (``docs/architecture.md``, "Device state:
  who changes it"). Over recurrent state (``HiMambaRadixCache``) a host hit ends at a checkpoint
  whose copy is on the host only (the node's KV may be on the device): it is loaded at any length
  (a load carrying a state is not held back by the threshold, as in SGLang), and the request's
  state slot then forks the loaded checkpoint (a queued state copy, behind the load).
* with ``decode_retraction_backup == "host_pool"``: the retraction backup's hooks
  (``retraction_extension.RetractionBackupExtension`` over the host pool: backup at retraction,
  restore at re-admission after the load-back, held slots freed at ``poll``).
* with a storage tier (``tree.storage``): ``poll`` starts a prefetch for each waiting request
  (once per request: its match, then the stored run beyond it); ``after_admit`` takes it first
  (the policy's wait happens there; SGLang instead keeps the request waiting until
  ``check_prefetch_progress`` says so), so the pages are a host hit that the load-back brings to
  the device. A request released before admission drops its prefetch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.radix import HiRadixCache
from kvjax.serve.extension import ServingExtension, required_part
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.tiers.agreed_copy_engine import AgreedCopyEngine
from kvjax.transfers.retraction_backup import RetractionBackup

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.serve.serving_req import ServingReq


class HostTierExtension(ServingExtension):
    """See the module docstring. ``loaded_tokens``: key elements loaded back from the host."""

    # A session's held KV is ordinary locked tree KV: it is backed up to the host when released
    # and evicted, and a resumed turn needs no load-back.
    keeps_session_kv = True

    def __init__(self, cache: KVCache) -> None:
        tree = required_part(cache.tree_cache, HiRadixCache, "the host tier extension")
        self.cache = cache
        self.tree = tree
        self.loaded_tokens = 0
        self.loads = 0
        self.scheduler: Any = None
        self.prefetched_tokens = 0  # tokens inserted from the storage tier
        self._prefetch_seen: set[Any] = set()
        self.retraction: RetractionBackup | None = None
        self._retraction: RetractionBackupExtension | None = None  # the shared restore logic
        self._agreed: AgreedCopyEngine | None = None  # several processes: the agreed engine
        if cache.plan.decode_retraction_backup == "host_pool":
            self.retraction = RetractionBackup("host_pool", cache.token_to_kv_pool_allocator.page_size, host=tree.host)
            self._retraction = RetractionBackupExtension(cache, self.retraction)

    def attach(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        agreement = getattr(scheduler, "agreement", None)
        if agreement is not None and not agreement.is_local:
            # Several processes: every transfer completion is agreed before it changes the tree.
            self._agreed = AgreedCopyEngine(self.tree.host.engine, agreement)
            self.tree.host.engine = self._agreed
            if self.tree.storage is not None:  # and every storage hit and prefetched page count
                self.tree.storage.agreement = agreement
        if self._retraction is not None:
            self._retraction.attach(scheduler)

    def poll(self) -> None:
        if self._agreed is not None:
            self._agreed.agree_round()
        # Nothing running while requests wait: no device work to overlap with, and a pending
        # backup's lock may be all that keeps a waiting request out (asynchronous copies, e.g. a
        # pool sharded over several devices), so wait for the transfers in flight to land. The
        # condition is the scheduler's state, the same on every process.
        sched = self.scheduler
        idle = sched is not None and not sched.running and bool(sched.waiting or sched.chunked is not None)
        self.tree.check_transfers(wait=idle)
        if self._retraction is not None:
            self._retraction.poll()
        if self.tree.storage is not None and self.scheduler is not None:
            for req in self.scheduler.waiting:
                self._start_prefetch(req)

    def _start_prefetch(self, req: ServingReq) -> None:
        if req.rid in self._prefetch_seen:
            return
        self._prefetch_seen.add(req.rid)
        n = req.seqlen() - 1
        if n <= 0:
            return
        key = req.token_range(0, n)
        self.tree.start_prefetch(req.rid, self.tree.match_prefix(key, req.extra_key), key, req.extra_key)

    def after_admit(self, req: ServingReq) -> None:
        if self.tree.storage is not None:
            self._prefetch_seen.discard(req.rid)
            self.prefetched_tokens += self.tree.storage.finish_prefetch(req.rid)
        self._load_back(req)
        if self._retraction is not None:
            self._retraction.after_admit(req)

    def _load_back(self, req: ServingReq) -> None:
        tree = self.tree
        # A host hit needs a host-only node, or (recurrent state) a checkpoint on the host only.
        if not (tree.host_only_count or getattr(tree, "host_only_states", 0)) or req.req_pool_idx is None:
            return
        n = req.seqlen() - 1
        if n <= 0:
            return
        match = tree.match_prefix(req.token_range(0, n), req.extra_key)
        host_hit = int(getattr(match, "host_hit_length", 0))
        if host_hit < max(tree.host.load_back_threshold, 1):
            return
        quota = self._quota(req, match)
        sessions = getattr(self.scheduler, "sessions", None)
        while quota < host_hit and sessions is not None and sessions.release_one():
            quota = self._quota(req, match)  # a released session's KV is evictable: room to load into
        loaded = tree.init_load_back(match, mem_quota=quota)
        if loaded.prefix_len <= req.cache_protected_len:
            return
        lock = tree.inc_lock_ref(loaded.last_node)
        tree.dec_lock_ref(req.lock_receipt if req.lock_receipt is not None else req.last_node)
        self.loaded_tokens += loaded.prefix_len - req.cache_protected_len
        self.loads += 1
        req.lock_receipt = lock
        req.last_node = loaded.last_node
        req.prefix_indices = loaded.indices
        req.cache_protected_len = loaded.prefix_len
        self.cache.req_to_token_pool.write(req.req_pool_idx, 0, loaded.indices)
        fork = getattr(tree, "fork_into_request", None)
        if fork is not None:  # recurrent state: continue from the loaded checkpoint (HiMambaRadixCache)
            fork(req, loaded.last_node)

    def before_release(self, req: ServingReq, finished: bool) -> None:
        if self.tree.storage is not None:
            self.tree.storage.cancel_prefetch(req.rid)
            self._prefetch_seen.discard(req.rid)
        if self._retraction is not None:
            self._retraction.before_release(req, finished)

    def _quota(self, req: ServingReq, match: Any) -> int:
        """Device tokens a load-back may take: free + evictable, less what the batch already
        promised (``scheduler.reserved_tokens``) and what this request still computes after the
        hit (rounded up to pages, plus one page), so admission never runs short because of it."""
        alloc = self.cache.token_to_kv_pool_allocator
        ps = alloc.page_size
        reserved = self.scheduler.reserved_tokens if self.scheduler is not None else 0
        rest = req.seqlen() - match.prefix_len - match.host_hit_length
        rest = (-(-max(rest, 0) // ps) + 1) * ps
        return alloc.available_size() + self.tree.evictable_size() - reserved - rest

    def in_lockstep(self, layout: Any, rank: int, shared: dict[str, Any]) -> bool:
        """Lockstep DP (``kvjax.dp.lockstep``): runs when every engine the tree's transfers go
        through is DP rank ``rank``'s own (what ``build_dp_kv_cache`` gives each rank:
        ``kvjax.dp.rank_transfer.RankPageTransferEngine`` for pages,
        ``kvjax.dp.rank_state_transfer.RankStateTransferEngine`` for recurrent-state checkpoints;
        a composed engine, such as a speculative draft's pair or the sliding-window pair, lists its
        members as ``engines``): its loads and retraction restores then write only the rank's slice
        of the stacked pools, on the rank's queue. A storage tier's prefetches write host pages only."""
        from kvjax.dp.rank_state_transfer import RankStateTransferEngine
        from kvjax.dp.rank_transfer import RankPageTransferEngine

        engine = self._agreed.engine if self._agreed is not None else self.tree.host.engine
        pending, members = [engine], []
        while pending:
            e = pending.pop()
            parts = getattr(e, "engines", None)
            if parts is None:
                members.append(e)
            else:
                pending.extend(parts)
        own = (RankPageTransferEngine, RankStateTransferEngine)
        return all(isinstance(e, own) and e.rank == rank for e in members)

    def host_balanced(self) -> bool:
        """``available + evictable + protected + held == capacity`` for the host pool."""
        host = self.tree.host_allocator
        s = self.tree.sizes()["host"]
        return host.available_size() + s.evictable + s.protected + self.tree.host.held_tokens == host.size
