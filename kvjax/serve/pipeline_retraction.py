"""The decode retraction backup over pipeline stages: every stage's layers copied aside and restored.

A retracted request's KV lives on every stage (one slot id per token, each stage holding its own
layers behind it), so its backup must copy each stage's pools, and its restore write each stage's
copy back into the same fresh slots. Both modes of ``kvjax.transfers.retraction_backup`` do:

* ``host_pool``: the host tier's engine over stages is already a
  ``kvjax.transfers.draft_pools.PairedCopyEngine`` of every stage's engine (built by
  ``kvjax.serve.pipeline_cache``), so the host tier's own backup copies every stage's pages into
  the same held host slots and loads them back; nothing here.
* ``cpu_tensor``: :class:`StagedRetractionBackup`, one ``RetractionBackup`` per stage, stage
  ``s``'s reading and recording through stage ``s``'s queue of pending device updates
  (``PipelineCache.pending[s]``); the owner of the step applies each stage's queue before that
  stage's step (``PipelineStages.forward``). A backup is kept only when every stage's copy was
  taken (else none is: the request recomputes), so the stages never disagree.

What stage ``s`` copies is what its kinds copy of its own pools (``kvjax.serve.kinds.retraction_parts``
over :func:`stage_view`: stage ``s``'s plan, pools and queue behind stage 0's request table,
allocator and tree): the ``"kv"`` pool where the stage has full-attention layers; a hybrid
sliding-window pool's full side (where the stage has full layers) and the window of its sliding
side, through stage 0's full-to-SWA slot mapping (one SWA slot id per token on every stage); a
recurrent-state pool's rows at the request's state slot (where the stage has recurrent layers);
a draft's pool where the stage holds it. The tree's queued state copies (a matched checkpoint
forked into the request's new slot) are recorded on every stage holding state before the first
stage's state restore, so every stage's restored state replaces the forked one, as on one device
(``kvjax.serve.recurrent_retraction``). Where some stage's state cannot be backed up (a
pool other processes hold part of) no backup is attached: retracted requests recompute.

``staged_extensions(pipeline)`` are the default serving extensions of stage 0's cache with the
``cpu_tensor`` backup made every stage's. Units: tokens and slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.serve.kinds import default_extensions, retraction_parts
from kvjax.serve.pipeline_state import state_stages
from kvjax.serve.recurrent_retraction import tree_copies_recorder
from kvjax.serve.retraction_extension import RetractionBackupExtension, copyable_backup
from kvjax.transfers.retraction_backup import RetractedKV, RetractionBackup, RowPart

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.serve.extension import ServingExtension
    from kvjax.serve.pipeline_cache import PipelineCache

__all__ = ["StagedRetractionBackup", "stage_view", "staged_cpu_tensor_backup", "staged_extensions"]


class StagedRetractionBackup:
    """``cpu_tensor`` backups of every stage at once, with ``RetractionBackup``'s interface
    (module docstring). ``stages[s]`` copies stage ``s``'s pools; stage 0's answers what is kept
    (its counters are the backup's: every stage keeps and restores the same requests)."""

    mode = "cpu_tensor"

    def __init__(self, stages: Sequence[RetractionBackup]) -> None:
        if not stages or any(b.mode != "cpu_tensor" for b in stages):
            raise ValueError("StagedRetractionBackup: one cpu_tensor RetractionBackup per stage")
        self.stages = tuple(stages)

    @property
    def _first(self) -> RetractionBackup:
        return self.stages[0]

    def __contains__(self, key: Any) -> bool:
        return key in self._first

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools the stages' backups copy (each stage's own; the draft's ``"kv_draft"`` is
        the last stage's)."""
        return tuple(dict.fromkeys(name for backup in self.stages for name in backup.pool_names))

    @property
    def held(self) -> int:
        return self._first.held

    @property
    def backed_up(self) -> int:
        return self._first.backed_up

    @property
    def restored(self) -> int:
        return self._first.restored

    @property
    def restored_tokens(self) -> int:
        return self._first.restored_tokens

    @property
    def fallbacks(self) -> int:
        return self._first.fallbacks

    def backup(self, key: Any, slots: np.ndarray, start: int, end: int, request: Any = None) -> bool:
        """Every stage's copy of tokens ``[start, end)`` at ``slots``; all or none kept."""
        for s, stage in enumerate(self.stages):
            if not stage.backup(key, slots, start, end, request):
                for taken in self.stages[:s]:
                    taken.discard(key)
                return False
        return True

    def peek(self, key: Any) -> RetractedKV | None:
        return self._first.peek(key)

    def pages_from(self, key: Any, token: int) -> int:
        return self._first.pages_from(key, token)

    def restore(self, key: Any, device_slots: np.ndarray, from_token: int | None = None, request: Any = None) -> bool:
        """Every stage's copy from ``from_token`` on written into ``device_slots`` (recorded on each
        stage's queue); a ``cpu_tensor`` restore does not fail once taken."""
        return all([stage.restore(key, device_slots, from_token, request) for stage in self.stages])

    def poll(self, wait: bool = False) -> int:
        return sum(stage.poll(wait) for stage in self.stages)

    def discard(self, key: Any) -> None:
        for stage in self.stages:
            stage.discard(key)


def stage_view(pipeline: PipelineCache, stage: int) -> KVCache:
    """Stage ``stage``'s pools, plan and queue of pending device updates behind stage 0's request
    table, allocator and tree: the cache a kind's retraction parts are built over for that stage
    (stage 0's cache itself for stage 0)."""
    from kvjax.build import KVCache

    if stage == 0:
        return pipeline.cache
    first = pipeline.cache
    return KVCache(
        plan=pipeline.plans[stage],
        pools=pipeline.pools(stage),
        req_to_token_pool=first.req_to_token_pool,
        token_to_kv_pool_allocator=first.token_to_kv_pool_allocator,
        tree_cache=first.tree_cache,
        pending=pipeline.pending[stage],
        state=pipeline.states[stage],
    )


def staged_cpu_tensor_backup(pipeline: PipelineCache) -> StagedRetractionBackup | None:
    """The ``cpu_tensor`` backup of every stage of ``pipeline`` through the page kernels: on each
    stage what its kinds copy of its own pools (module docstring); ``None`` when a stage's state
    cannot be backed up (retracted requests then recompute)."""
    backups = []
    for s in range(pipeline.pp_size):
        view = stage_view(pipeline, s)
        backup = copyable_backup(view, retraction_parts(view))
        if backup is None:
            return None
        backups.append(backup)
    _record_tree_copies_once(pipeline, backups)
    return StagedRetractionBackup(backups)


def _record_tree_copies_once(pipeline: PipelineCache, backups: Sequence[RetractionBackup]) -> None:
    """The tree's queued state copies (a matched checkpoint forked into the restored request's new
    slot among them) recorded on every stage holding state before the first stage's state
    restore, once: each stage's row restore then lands behind them (``kvjax.serve.pipeline_state``)."""
    queues = tuple(pipeline.pending[s] for s in state_stages(pipeline))
    tree = pipeline.cache.tree_cache
    first = True
    for backup in backups:
        parts = []
        for part in backup.parts:
            if isinstance(part, RowPart) and part.before_restore is not None:
                part = replace(part, before_restore=tree_copies_recorder(tree, queues) if first else None)
                first = False
            parts.append(part)
        backup.parts = tuple(parts)


def staged_extensions(pipeline: PipelineCache) -> list[ServingExtension]:
    """``default_extensions`` of stage 0's cache, its ``cpu_tensor`` retraction backup (if the plan
    asks for one) copying every stage (module docstring), or dropped where a stage's state cannot
    be backed up."""
    extensions = [e for e in default_extensions(pipeline.cache) if type(e) is not RetractionBackupExtension]
    plan = pipeline.cache.plan
    if plan.decode_retraction_backup == "cpu_tensor" and plan.decode_retraction_active:
        backup = staged_cpu_tensor_backup(pipeline)
        if backup is not None:
            extensions.append(RetractionBackupExtension(pipeline.cache, backup))  # type: ignore[arg-type]
    return extensions
