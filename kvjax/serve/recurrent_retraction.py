"""What the ``cpu_tensor`` retraction backup copies of a recurrent-state cache's state pool.

A hybrid SSM model (Qwen3-Next, Nemotron-H) keeps, per request, one state slot
(``req.mamba_pool_idx``) of the recurrent pool ``pools.recurrent``: every recurrent layer's conv
state and temporal (SSM) state after the request's tokens ``[0, kv_len)``. Its full-attention
layers' KV is in the ``"kv"`` pool at the request's token slots, copied as for any cache. A
retracted request's backup (``kvjax.transfers.retraction_backup``) adds a
:class:`~kvjax.transfers.retraction_backup.RowPart`:

* at the retraction, the rows of the request's state slot, every layer and array, copied to numpy
  (``kvjax.transfers.state_transfer.copy_state_rows``, the state engine's row gather; O(1 slot))
  before the slot is freed or donated to the tree;
* at the re-admission, the copy written into the state slot the request was given then
  (``load_state_rows``, the row scatter with the pool donated: in place), recorded as a pending
  device update (``cache.pending``) like the KV pages' restore.

What comes from where (as SGLang 0.5.23's ``Req.load_kv_cache``: ``MambaPool.load_cpu_copy`` into
the request's ``mamba_pool_idx``, with the KV pages): the request resumes at its old ``kv_len``, so
its state must be the state after all of those tokens, which only the backup holds. The KV of the
tokens its new tree prefix covers comes from the tree (only the pages past it are restored), but
the state never comes from the tree's checkpoint: a match ending at a checkpoint queues the fork of
that checkpoint (the state after the shorter prefix) into the request's new slot
(``RecurrentStateExtension.after_admit``); the restore records the tree's queued copies first
(``before_restore``) and its own write behind them, so the restored state replaces the forked one.
When the tree holds the whole of ``[0, kv_len)`` again (a checkpoint at ``kv_len``: the request's
own state, donated at an earlier caching), the backup is dropped and the tree's state serves.
SGLang restores only the state slot, not the extra buffer's ping-pong slots; neither does this
(the tracking starts again from the resumed length).

Over pipeline stages each stage's backup copies its own recurrent layers' rows at the same slot
(``kvjax.serve.pipeline_retraction``; a stage without recurrent layers copies none), and the tree's
queued copies are recorded on every stage holding state before the first stage's restore.

Under lockstep DP attention (``rank_state_part``, from the extension's ``in_lockstep``) the rows
are the rank's own: copied from its slice of the stacked state pool and written back into it only
(``kvjax.dp.rank_state_transfer``), the tree's queued copies recorded as the rank's copies.

Not backed up (retracted requests recompute): a pool not fully addressable by this process
(several processes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.plan.kinds.recurrent import POOL as STATE_POOL
from kvjax.radix.mamba_radix_cache import MambaRadixCache
from kvjax.transfers.retraction_backup import RowPart
from kvjax.transfers.state_transfer import copy_state_rows, load_state_rows, state_copies_update
from kvjax.transfers.transfer import PoolRef

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.device_updates import DeviceUpdate, PendingDeviceUpdates

__all__ = ["rank_state_part", "recurrent_retraction_parts", "tree_copies_recorder"]


def _state_slot(request: Any) -> np.ndarray | None:
    """The request's state slot (``mamba_pool_idx``), or ``None`` when it holds none."""
    slot = getattr(request, "mamba_pool_idx", None)
    return None if slot is None else np.asarray([int(slot)], np.int64)


def recurrent_retraction_parts(cache: KVCache) -> list[RowPart] | None:
    """The request's state slot of ``cache``'s recurrent pool (module docstring); none for a
    pipeline stage without recurrent layers; ``None`` where the state cannot be backed up here (a
    pool other processes hold part of)."""
    if STATE_POOL.name not in cache.pools:  # a pipeline stage without recurrent layers: nothing to copy here
        return []
    if not all(a.is_fully_addressable for a in cache.pools[STATE_POOL.name].arrays()):
        return None
    return [
        RowPart(
            PoolRef(STATE_POOL.name),
            rows=_state_slot,
            get_copy=copy_state_rows,
            load_copy=load_state_rows,
            before_restore=tree_copies_recorder(cache.tree_cache, (cache.pending,)),
        )
    ]


def tree_copies_recorder(
    tree: Any,
    queues: Sequence[PendingDeviceUpdates],
    copies_update: Callable[[list[tuple[int, int]]], DeviceUpdate] = state_copies_update,
) -> Callable[[], None]:
    """A ``RowPart.before_restore``: the tree's queued state copies (the fork of a matched
    checkpoint into the request's new slot among them) taken and recorded as one update
    (``copies_update``) on each of ``queues``, so they land before the restore that replaces the
    slot's state."""

    def record() -> None:
        copies = tree.take_state_copies() if isinstance(tree, MambaRadixCache) else []
        if copies:
            for queue in queues:
                queue.record(copies_update(copies))

    return record


def rank_state_part(part: RowPart, cache: KVCache, layout: Any, rank: int) -> RowPart:
    """``part`` (:func:`recurrent_retraction_parts`') made DP rank ``rank``'s under lockstep DP
    attention: its rows copied from and written into the rank's slice of the stacked state pool
    (``kvjax.dp.rank_state_transfer.rank_state_row_copies``), the tree's queued copies recorded
    through the ranks' ``RankStateCopies`` (``kvjax.dp.rank_state``) on the rank's queue."""
    import functools

    from kvjax.dp.rank_state import rank_state_copies
    from kvjax.dp.rank_state_transfer import rank_state_row_copies

    get_copy, load_copy = rank_state_row_copies(rank)
    update = functools.partial(rank_state_copies(layout).update, rank)
    record = tree_copies_recorder(cache.tree_cache, (cache.pending,), update)
    return replace(part, get_copy=get_copy, load_copy=load_copy, before_restore=record)
