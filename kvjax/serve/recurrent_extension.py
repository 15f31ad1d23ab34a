"""`RecurrentStateExtension`: the serving hooks of a recurrent-state pool (hybrid SSM models).

* **admission** (``after_admit``): the request gets a state slot from the request table
  (``HybridReqToTokenPool.alloc_reqs``: one, plus the ping-pong slots with the extra buffer; when
  fewer are free, as many unlocked tree checkpoints as are short are evicted first, as SGLang's
  ``ensure_mamba_capacity``; then ``OutOfMemoryError`` naming what is short). With a
  ``MambaRadixCache`` the match ended at a checkpoint: its slot is forked into the request's (a
  queued copy), so the request continues from the state after its cached prefix.
* **step inputs** (``step_metadata`` -> ``AttentionMetadata.state``, a ``StateMetadata``): first
  every state copy the tree queued (forks of matched checkpoints, request states copied into new
  checkpoints by ``cache_unfinished_req``) is recorded, in order, as one pending device update of
  ``pools.recurrent`` (``cache.pending``): the owner of the step applies it right before
  launching the step (the scheduler does), so the step reads the forked slots; the extension
  never swaps ``cache.pools``. Then per sequence row its state slot (``state_slots``, 0 for
  padding rows) and whether it continues a state (``has_initial_state``: the row's KV did not
  start at 0 in this step).
* **extra buffer** (``enable_mamba_extra_buffer``, page size > 1): a row whose tokens in this step
  reach a page boundary also writes the state at its last one into a ping-pong slot (the one not
  holding the previous tracked state); ``after_step`` records it (``req.mamba_last_track_idx`` /
  ``mamba_last_track_seqlen``), and the tree's caching donates that slot as the checkpoint.
* **release**: the tree's lifecycle donates the request's state as a checkpoint, or frees it
  (``MambaRadixCache.cleanup_after_caching_req``); with a tree that keeps no checkpoints (radix
  cache off) the request's slots are freed here (``before_release``).

A request that could not be admitted after all (no KV room) keeps its slot while it waits; its
next admission reuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.attention import StateMetadata
from kvjax.device_updates import DeviceUpdate
from kvjax.errors import OutOfMemoryError
from kvjax.hybrid_req_pool import HybridReqToTokenPool
from kvjax.radix.mamba_radix_cache import MambaRadixCache
from kvjax.serve.extension import ServingExtension, StepBatch, required_part
from kvjax.transfers.state_transfer import state_copies_update

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.device_updates import PendingDeviceUpdates
    from kvjax.serve.serving_req import ServingReq

__all__ = ["RecurrentStateExtension", "state_copies_update"]


class RecurrentStateExtension(ServingExtension):
    """See the module docstring. ``cache``: a built hybrid-SSM cache (``pools.recurrent``, a
    ``HybridReqToTokenPool`` request table).

    Attributes:
        copies_update: ``copies_update(copies) -> DeviceUpdate``, the device update that applies
            the tree's state copies ``(src slot, dst slot)`` in order (default
            :func:`state_copies_update`, over a cache's own pools). A cache whose pools hold
            several ranks' state (DP attention) sets one that writes only its rank's slice.
        queues: the queues of pending device updates each batch of copies is recorded on, one
            update per queue, each applied to its owner's pools (default: ``cache.pending``).
            Over pipeline stages: every stage's that holds recurrent state
            (``kvjax.serve.pipeline_state``).
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.copies_update: Callable[[list[tuple[int, int]]], DeviceUpdate] = state_copies_update
        self.queues: tuple[PendingDeviceUpdates, ...] = (cache.pending,)
        self.table = required_part(cache.req_to_token_pool, HybridReqToTokenPool, "a recurrent-state cache")
        tree = cache.tree_cache
        self.tree = tree if isinstance(tree, MambaRadixCache) and not tree.disable else None
        self.page_size = int(cache.allocator.page_size)
        # The state tracked for a request by the last batch packed with it (a pipeline step packs
        # one per micro-batch before their after_step): (request, ping-pong index, length).
        self._tracked: dict[int, tuple[ServingReq, int, int]] = {}

    def after_admit(self, req: ServingReq) -> None:
        need = self.table.state_slots_needed([req])
        free = self.table.mamba_allocator.available_size()
        if need > free and self.tree is not None:
            # As SGLang's ensure_mamba_capacity: evict the whole shortfall (1 + the ping-pong
            # slots with the extra buffer), not one checkpoint.
            self.tree.evict(num_tokens=0, mamba_num=need - free)
        if self.table.alloc_reqs([req]) is None:
            evictable = self.tree.mamba_evictable_size() if self.tree is not None else 0
            free = self.table.mamba_allocator.available_size()
            raise OutOfMemoryError(
                f"request {req.rid!r}: needs {need} recurrent-state slots, {free} "
                f"of {self.table.mamba_pool_size} are free and {evictable} checkpoints are evictable (the others are "
                "held by running requests or locked); raise max_mamba_cache_size (or mamba_full_memory_ratio) or "
                "lower max_running_requests"
            )
        req.mamba_cow_src_index = None
        if self.tree is not None and req.last_node is not None and req.last_node is not self.tree.root:
            src = self.tree.mamba.slot_of(req.last_node)
            if src is not None:
                req.mamba_cow_src_index = src
                # Behind the tree's queued copies: the checkpoint may have been donated this step.
                assert req.mamba_pool_idx is not None
                self.tree.queue_state_copy(src, req.mamba_pool_idx)

    def step_metadata(self, batch: StepBatch) -> StateMetadata:
        self._record_state_copies()
        n = len(batch.reqs)
        slots = np.zeros(batch.max_seqs, np.int32)
        slots[:n] = [0 if r.mamba_pool_idx is None else r.mamba_pool_idx for r in batch.reqs]
        keep = np.zeros(batch.max_seqs, np.int32)
        keep[:n] = np.asarray(batch.starts) > 0
        track_slots = np.zeros(batch.max_seqs, np.int32)
        track_at = np.zeros(batch.max_seqs, np.int32)
        if self.table.enable_mamba_extra_buffer:
            page = self.page_size
            for i, (req, start, end) in enumerate(zip(batch.reqs, batch.starts, batch.seq_lens, strict=True)):
                self._tracked.pop(id(req), None)  # a batch packed before and never stepped tracks nothing now
                aligned = int(end) // page * page
                pp = req.mamba_ping_pong_track_buffer
                if aligned <= int(start) or pp is None:
                    continue  # no page boundary among this step's tokens
                last = req.mamba_last_track_idx
                idx = 0 if last is None else self.table.get_mamba_ping_pong_other_idx(last)
                track_slots[i] = int(pp[idx])
                track_at[i] = aligned - int(start)
                self._tracked[id(req)] = (req, idx, aligned)
        make_part: Any = StateMetadata  # numpy leaves on the host (device arrays inside the step)
        part: StateMetadata = make_part(
            state_slots=slots, has_initial_state=keep, track_slots=track_slots, track_at=track_at
        )
        return part

    def _record_state_copies(self) -> None:
        """Record the tree's queued state copies (forks, new checkpoints) as one pending device
        update on each of :attr:`queues`, behind every update recorded there before (the owner
        applies them before the step)."""
        copies: list[tuple[int, int]] = self.tree.take_state_copies() if self.tree is not None else []
        if copies:
            for queue in self.queues:
                queue.record(self.copies_update(copies))

    def after_step(self, batch: StepBatch) -> None:
        """With the extra buffer: the tracked states of ``batch``'s requests are written; record
        where (the caching that follows donates the slot of the last one), each request's as its
        last packed batch tracked it (a pipeline step packs each micro-batch before any of them is
        stepped). A state tracked past a row's ``seq_lens`` is not recorded: a speculative round
        reports the tokens it kept (``kvjax.serve.speculative.draft_decoding``), and a state tracked
        after a rejected draft token is of no prefix (its ping-pong slot is written again later)."""
        for req, end in zip(batch.reqs, batch.seq_lens, strict=True):
            tracked = self._tracked.pop(id(req), None)
            if tracked is None or tracked[0] is not req or tracked[2] > int(end):
                continue
            _, idx, aligned = tracked
            req.mamba_last_track_idx = idx
            req.mamba_last_track_seqlen = aligned

    def before_release(self, req: ServingReq, finished: bool) -> None:
        self._tracked.pop(id(req), None)
        if self.tree is None:
            self.table.free_mamba_cache(req)

    def before_decode(self, reqs: Sequence[ServingReq]) -> None:
        """Nothing: each decode step continues every request's own slot."""

    def can_run_ahead(self, reqs: Sequence[ServingReq]) -> bool:
        """Not when a request may stop on a stop token: the speculative step would advance its
        state, which its release donates to the tree as the checkpoint of its (shorter) tokens.
        (Requests that end on ``max_new_tokens`` never get a speculative step.)"""
        return not any(req.stop_token_ids for req in reqs)

    def in_lockstep(self, layout: Any, rank: int, shared: dict[str, Any]) -> bool:
        """Under lockstep DP the state copies write rank ``rank``'s slice of the stacked pool
        (``kvjax.dp.rank_state``; one ``RankStateCopies`` shared by the ranks and their host-tier
        state engines)."""
        import functools

        from kvjax.dp.rank_state import rank_state_copies

        self.copies_update = functools.partial(rank_state_copies(layout).update, rank)
        return True


def holds_state(cache: Any) -> bool:
    """Whether ``cache`` holds recurrent state on this rank (a pipeline stage may not)."""
    from kvjax.plan.kinds.recurrent import POOL

    return POOL.name in cache.pools
