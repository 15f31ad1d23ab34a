"""Recurrent state over pipeline stages: every state copy the tree records, applied on every stage.

A hybrid recurrent model (Qwen3-Next, Nemotron-H) served over ``pp_size`` stages keeps each
stage's recurrent layers' state on that stage's devices: stage ``s``'s ``"recurrent"`` pool holds
the state of the recurrent layers of ``stage_bounds(num_layers, pp_size, s)`` (planned with
``pp_rank=s``; a stage without recurrent layers holds none). As SGLang 0.5.23 gives each PP rank
a mamba pool of its own layers, kvjax gives every stage the same slots (the planner gives every
stage the fewest any stage holds: ``kvjax.plan.sizing``), so one slot id names one request's (or
one checkpoint's) state on every stage, and the state allocator of stage 0's request table
(``HybridReqToTokenPool``) drives them all, as its token allocator drives every stage's KV.

What changes a slot's state:

* the step: each stage's step writes its own layers' state at the row's slot (the state metadata
  is packed once and is the same on every stage, like the KV metadata);
* the tree's state copies (a matched checkpoint forked into a request's slot at admission, a
  request's state copied into a new checkpoint when it is cached): the one
  ``RecurrentStateExtension`` over stage 0's cache records each batch of copies, one update built
  by its ``copies_update`` (``kvjax.transfers.state_transfer.state_copies_update``) per queue, on
  every stage's queue of pending device updates that holds state (``PipelineCache.pending[s]``),
  and the stepping applies each stage's queue before that stage's step
  (``PipelineStages.forward``). SGLang's PP ranks each run the same scheduler decisions and copy
  on their own pool; here one tree decides and each stage's queue carries the same copies.

Not served over stages (refused by name before anything is built): the host tier for these
models (``kvjax.pipeline_check``: one state engine would take and load back stage 0's
checkpoints only) and DP attention (``kvjax.dp.pipeline``). The ``cpu_tensor`` retraction backup
copies each stage's state rows at the request's slot (``kvjax.serve.pipeline_retraction``). The extra buffer
(``enable_mamba_extra_buffer``) is served with several micro-batches: its tracked states are
recorded per packed batch (``RecurrentStateExtension.after_step``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.plan.kinds.recurrent import POOL
from kvjax.serve.recurrent_extension import RecurrentStateExtension

if TYPE_CHECKING:
    from kvjax.serve.extension import ServingExtension
    from kvjax.serve.pipeline_cache import PipelineCache

__all__ = ["staged_state_copies", "state_stages"]


def state_stages(pipeline: PipelineCache) -> tuple[int, ...]:
    """The stages whose pools hold recurrent state (those with recurrent layers)."""
    return tuple(s for s in range(pipeline.pp_size) if POOL.name in pipeline.pools(s))


def staged_state_copies(pipeline: PipelineCache, extensions: list[ServingExtension]) -> list[ServingExtension]:
    """``extensions`` with the recurrent-state copies recorded on every stage that holds state
    (module docstring): the ``RecurrentStateExtension`` among them records on those stages'
    queues; when none is there (stage 0 holds no recurrent layers, so its cache built none) one
    over stage 0's cache is put first, where the kinds' order puts it. ``extensions`` itself,
    changed in place; unchanged for a model without recurrent layers."""
    stages = state_stages(pipeline)
    if not stages:
        return extensions
    found = [e for e in extensions if isinstance(e, RecurrentStateExtension)]
    if not found:
        found = [RecurrentStateExtension(pipeline.cache)]
        extensions.insert(0, found[0])
    for extension in found:
        extension.queues = tuple(pipeline.pending[s] for s in stages)
    return extensions
