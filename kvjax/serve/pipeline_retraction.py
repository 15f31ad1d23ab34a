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

``staged_extensions(pipeline)`` are the default serving extensions of stage 0's cache with the
``cpu_tensor`` backup's copies made every stage's (the ``"kv"`` pool and a draft's; a cache whose
kinds copy pools of their own, the sliding-window pair, recomputes its retracted requests over
stages). Units: tokens and slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.serve.kinds import default_extensions
from kvjax.serve.retraction_extension import RetractionBackupExtension, _page_copy, _page_load
from kvjax.transfers.draft_pools import with_draft_pool
from kvjax.transfers.retraction_backup import RetractedKV, RetractionBackup

if TYPE_CHECKING:
    from kvjax.serve.extension import ServingExtension
    from kvjax.serve.pipeline_cache import PipelineCache

__all__ = ["StagedRetractionBackup", "staged_cpu_tensor_backup", "staged_extensions"]


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
        """The pools each stage's backup copies (stage 0's)."""
        return self._first.pool_names

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


def staged_cpu_tensor_backup(pipeline: PipelineCache) -> StagedRetractionBackup:
    """The ``cpu_tensor`` backup of every stage of ``pipeline`` through the page kernels."""
    page_size = pipeline.cache.token_to_kv_pool_allocator.page_size
    return StagedRetractionBackup(
        [
            RetractionBackup(
                "cpu_tensor",
                page_size,
                pending=queue,
                parts=with_draft_pool(("kv",), queue.owner_pools),
                get_copy=_page_copy,
                load_copy=_page_load,
            )
            for queue in pipeline.pending
        ]
    )


def staged_extensions(pipeline: PipelineCache) -> list[ServingExtension]:
    """``default_extensions`` of stage 0's cache, its ``cpu_tensor`` retraction backup (if any)
    copying every stage (module docstring)."""
    extensions = default_extensions(pipeline.cache)
    for ext in extensions:
        if type(ext) is RetractionBackupExtension and ext.retraction.mode == "cpu_tensor":
            if ext.retraction.pool_names != tuple(with_draft_pool(("kv",), pipeline.cache.pools)):
                # A kind with pools of its own (the sliding-window pair) is not copied per stage
                # yet: its retracted requests recompute.
                extensions.remove(ext)
                break
            ext.retraction = staged_cpu_tensor_backup(pipeline)  # type: ignore[assignment]  # its interface
    return extensions
