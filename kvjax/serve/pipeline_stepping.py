"""Serving over pipeline stages: the `PipelineStages` stepping, every stage's step, micro-batches.

``pipeline_scheduler(spec, pipeline, params, micro_batches=M)`` is the ``Scheduler`` (admission,
eviction, retraction, overlap scheduling: all host decisions) over a ``PipelineCache``, given a
``PipelineStages`` stepping (``kvjax.serve.stepping``): the tree, allocator and request table of
stage 0's cache drive every stage, so the host side is unchanged; only the dispatch of a step
differs.

A step's batch (its ``n`` sequence rows, in the scheduler's order) is split into micro-batches of
``ceil(max_batch_size / M)`` rows: micro-batch ``g`` holds rows ``[g * rows, (g + 1) * rows)``,
with its own packed metadata (its own page tables, its own token bucket). Each micro-batch is
dispatched stage by stage (stage 0's step on its tokens, the hidden states moved to the next
stage's devices with ``jax.device_put``, ...), micro-batch after micro-batch. Dispatch is
asynchronous and the stages own disjoint devices, so stage ``s + 1`` on micro-batch ``g`` runs
while stage ``s`` runs micro-batch ``g + 1``: the pipeline fills and drains once per step, with no
schedule to write. Each stage's pools pass from one micro-batch's call to the next (donated), so
within a stage the micro-batches run in order, and their writes are disjoint slots.

The last stage's sampled tokens (and logits) of the micro-batches are concatenated in batch order
into ``[M * rows]`` (padded with zeros when fewer micro-batches ran): row ``i`` is sequence ``i``,
as in the one-stage step, so overlap scheduling's ``token_src`` indexes it the same way (the
previous step's tokens are moved to stage 0's devices once per step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import MetadataBuilder
from kvjax.device_state import DeviceState
from kvjax.errors import ConfigError
from kvjax.serve.model import as_model_config
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.pipeline_cache import PipelineCache
from kvjax.serve.pipeline_retraction import staged_extensions
from kvjax.serve.pipeline_state import staged_state_copies
from kvjax.serve.pipeline_step import make_stage_step, place_stage
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.stepping import StepOwner, StepRows
from kvjax.spec import ModelSpec

__all__ = ["PipelineStages", "pipeline_scheduler"]


def pipeline_scheduler(
    spec: ModelSpec | ModelConfig,
    pipeline: PipelineCache,
    params: dict,
    *,
    micro_batches: int = 1,
    **scheduler_args: Any,
) -> Scheduler:
    """A ``Scheduler`` over the stages of ``pipeline`` (module docstring).

    ``params``: the whole model's weights; each stage keeps (on its devices) only what it runs
    (``stepping.stage_params[s]``; the scheduler's ``params`` are stage 0's). ``micro_batches``:
    how many row groups a step's batch is split into (1 to ``max_batch_size``). The other
    arguments are ``Scheduler``'s (its ``extensions`` default to
    ``pipeline_retraction.staged_extensions``: a ``cpu_tensor`` retraction backup copies every
    stage; given or not, their recurrent-state copies are recorded on every stage holding state:
    ``pipeline_state.staged_state_copies``; the extra buffer's tracked states are recorded per
    micro-batch); a model of the caller's own (``model=``) is not served over stages
    (``ConfigError``, nothing built).
    """
    if scheduler_args.get("model") is not None:
        raise ConfigError("model", "a model of the caller's own", "pipeline stages serve the built-in families")
    max_batch = min(scheduler_args.get("max_batch_size", 16), pipeline.cache.req_to_token_pool.size)
    if not 1 <= micro_batches <= max_batch:
        raise ConfigError(
            "micro_batches", micro_batches, f"split the batch of {max_batch} rows into 1 to {max_batch} groups"
        )
    stepping = PipelineStages(pipeline, micro_batches, -(-max_batch // micro_batches))
    if scheduler_args.get("extensions") is None:  # the retraction backup copies every stage
        scheduler_args["extensions"] = staged_extensions(pipeline)
    # The recurrent-state copies land on every stage holding state.
    scheduler_args["extensions"] = staged_state_copies(pipeline, list(scheduler_args["extensions"]))
    return Scheduler(spec, pipeline.cache, params, stepping=stepping, **scheduler_args)


class PipelineStages:
    """Steps a batch over ``pipeline``'s stages in ``micro_batches`` groups of ``micro_rows`` rows
    (module docstring).

    After ``setup``: ``stage_steps[s]`` and ``stage_params[s]`` are stage ``s``'s compiled step and
    weights (on its sub-mesh); ``mesh`` is stage 0's sub-mesh.
    """

    def __init__(self, pipeline: PipelineCache, micro_batches: int, micro_rows: int) -> None:
        self.pipeline = pipeline
        self.micro_batches = micro_batches
        self.micro_rows = micro_rows
        self.mesh: Mesh | None = pipeline.meshes[0]
        self.stage_steps: list[Any] = []
        self.stage_params: tuple[dict, ...] = ()
        #: The last stage's step when a draft runs beside its head (``kvjax.serve.pipeline_eagle``):
        #: ``(pools, params, hidden, tokens, meta) -> (pools, next_tokens[, logits])``; None: its plain step.
        self.last_stage: Callable[..., tuple[Any, ...]] | None = None

    @property
    def states(self) -> tuple[DeviceState, ...]:
        return self.pipeline.states

    @property
    def step_fn(self) -> Any:
        """Stage 0's compiled step."""
        return self.stage_steps[0]

    def setup(self, scheduler: StepOwner, spec: ModelSpec | ModelConfig, model: Any) -> None:
        """Lay each stage's pools and weights out over its sub-mesh and compile its step; the
        scheduler's ``params`` become stage 0's weights."""
        config = as_model_config(spec)
        pipe = self.pipeline
        params: list[dict] = []
        for s, (stage, mesh) in enumerate(zip(pipe.stages, pipe.meshes, strict=True)):
            pools, own = place_stage(config, stage, mesh, pipe.pools(s), scheduler.params)
            scheduler.store_pools(pools, s)
            params.append(own)
            self.stage_steps.append(make_stage_step(config, stage, mesh, pools, with_logits=scheduler.record_logits))
        self.stage_params = tuple(params)
        scheduler.params = params[0]
        self.stage_replicated = tuple(NamedSharding(mesh, P()) for mesh in pipe.meshes)
        self.metadata = MetadataBuilder(scheduler.rows, scheduler.page_size, self.micro_rows)
        first = self.stage_replicated[0]
        self.no_tokens = jax.device_put(np.zeros(self.micro_rows * self.micro_batches, np.int32), first)
        last = self.stage_replicated[-1]
        self.pad_tokens = jax.device_put(np.zeros(self.micro_rows, np.int32), last)
        vocab = config.vocab_size
        self.pad_logits = (
            jax.device_put(np.zeros((self.micro_rows, vocab), np.float32), last) if scheduler.record_logits else None
        )

    def forward(self, scheduler: StepOwner, step: StepRows) -> tuple[jax.Array, jax.Array | None]:
        """The step over the stages, micro-batch by micro-batch (module docstring).

        Each micro-batch builds its own page table, so a kept ``page_table`` is not reused here,
        and none is left for the next step to reuse (``step_page_table`` is None).
        """
        scheduler.step_page_table = None
        start = time.perf_counter()
        n, mr = len(step.rows), self.micro_rows
        packed = [scheduler.pack(self.metadata, step, a, min(a + mr, n)) for a in range(0, n, mr)]
        prev = None
        if scheduler.overlap:
            prev = jax.device_put(scheduler.previous_tokens(self.no_tokens), self.stage_replicated[0])
        launched = time.perf_counter()
        pipe = self.pipeline
        # Each stage's pending device updates (the host tier's loads into its layers, the
        # recurrent-state copies) land first.
        pools = [pipe.apply_pending(s, pipe.pools(s)) for s in range(pipe.pp_size)]
        outs: list[tuple[Any, ...]] = []
        for group in packed:
            x: Any = group.tokens
            out: tuple[Any, ...] = ()
            for s, stage_step in enumerate(self.stage_steps):
                if s:
                    x = jax.device_put(x, self.stage_replicated[s])  # to the next stage's devices
                    if s == pipe.pp_size - 1 and self.last_stage is not None:  # a draft beside the head
                        out = self.last_stage(pools[s], self.stage_params[s], x, group.tokens, group.meta)
                    else:
                        out = stage_step(pools[s], self.stage_params[s], x, group.meta)
                else:
                    out = stage_step(pools[0], self.stage_params[0], x, group.meta, prev, group.token_src)
                pools[s], x = out[0], out[1]
            outs.append(out)
        pad = self.micro_batches - len(outs)
        next_tokens = _in_order([o[1] for o in outs] + [self.pad_tokens] * pad)
        logits = None
        if scheduler.record_logits:
            assert self.pad_logits is not None
            logits = _in_order([o[2] for o in outs] + [self.pad_logits] * pad)
        end = time.perf_counter()
        for s in range(pipe.pp_size):
            scheduler.store_pools(pools[s], s)
        scheduler.after_forward(packed, next_tokens, start, launched, end)
        return next_tokens, logits


def _in_order(parts: list[jax.Array]) -> jax.Array:
    """The micro-batches' outputs in batch order (one as it is)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
