"""The serving scheduler over pipeline stages: one scheduler, every stage's step, micro-batches.

``PipelineScheduler(spec, pipeline, params, micro_batches=M)`` is the ``Scheduler`` (admission,
eviction, retraction, overlap scheduling: all host decisions) over a ``PipelineCache``: the tree,
allocator and request table of stage 0's cache drive every stage, so the host side is unchanged;
only the dispatch of a step differs (``_forward``).

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
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import MetadataBuilder, MetadataPart
from kvjax.errors import ConfigError
from kvjax.serve.extension import StepBatch
from kvjax.serve.model import as_model_config
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.pipeline_cache import PipelineCache
from kvjax.serve.pipeline_step import make_stage_step, place_stage
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.spec import ModelSpec

__all__ = ["PipelineScheduler"]


class PipelineScheduler(Scheduler):
    """``Scheduler`` over the stages of ``pipeline`` (module docstring).

    ``params``: the whole model's weights; each stage keeps (on its devices) only what it runs,
    ``stage_params[s]`` (``params`` is then stage 0's).
    ``micro_batches``: how many row groups a step's batch is split into (1 to ``max_batch_size``).
    The other arguments are ``Scheduler``'s; a model of the caller's own (``model=``) is not
    served over stages (``ConfigError``).
    """

    def __init__(
        self,
        spec: ModelSpec | ModelConfig,
        pipeline: PipelineCache,
        params: dict,
        *,
        micro_batches: int = 1,
        **scheduler_args: Any,
    ) -> None:
        if scheduler_args.get("model") is not None:
            raise ConfigError("model", "a model of the caller's own", "pipeline stages serve the built-in families")
        max_batch = min(scheduler_args.get("max_batch_size", 16), pipeline.cache.req_to_token_pool.size)
        if not 1 <= micro_batches <= max_batch:
            raise ConfigError(
                "micro_batches", micro_batches, f"split the batch of {max_batch} rows into 1 to {max_batch} groups"
            )
        self.pipeline = pipeline
        self.micro_batches = micro_batches
        self.micro_rows = -(-max_batch // micro_batches)
        super().__init__(spec, pipeline.cache, params, **scheduler_args)
        self._micro_metadata = MetadataBuilder(self.rows, self.page_size, self.micro_rows)
        first = NamedSharding(pipeline.meshes[0], P())
        self._first_replicated = first
        self._no_tokens = jax.device_put(np.zeros(self.micro_rows * micro_batches, np.int32), first)
        last = NamedSharding(pipeline.meshes[-1], P())
        self._pad_tokens = jax.device_put(np.zeros(self.micro_rows, np.int32), last)
        vocab = as_model_config(spec).vocab_size
        self._pad_logits = (
            jax.device_put(np.zeros((self.micro_rows, vocab), np.float32), last) if self.record_logits else None
        )

    def _setup_step(self, spec: ModelSpec | ModelConfig, model: Any) -> None:
        """Lay each stage's pools and weights out over its sub-mesh and compile its step
        (``stage_steps``, ``stage_params``); ``params`` and ``step_fn`` become stage 0's weights
        and step, ``mesh`` its sub-mesh."""
        config = as_model_config(spec)
        pipe = self.pipeline
        params: list[dict] = []
        self.stage_steps = []
        for s, (stage, mesh) in enumerate(zip(pipe.stages, pipe.meshes, strict=True)):
            pools, own = place_stage(config, stage, mesh, pipe.pools(s), self.params)
            pipe.set_pools(s, pools)
            params.append(own)
            self.stage_steps.append(make_stage_step(config, stage, mesh, pools, with_logits=self.record_logits))
        self.stage_params: tuple[dict, ...] = tuple(params)
        self.params = params[0]  # the base class's name for the weights: stage 0's
        self.stage_replicated = tuple(NamedSharding(mesh, P()) for mesh in pipe.meshes)
        self.mesh = pipe.meshes[0]
        self.step_fn = self.stage_steps[0]

    def _forward(
        self,
        tokens: list[np.ndarray] | np.ndarray,
        starts: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        reqs: Sequence[ServingReq],
        token_src: np.ndarray | None = None,
        page_table: np.ndarray | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """``Scheduler._forward`` over the stages, micro-batch by micro-batch (module docstring).

        Each micro-batch builds its own page table, so a caller's unchanged ``page_table`` is not
        reused here, and none is left for the next step to reuse (``_step_page_table`` is None).
        """
        del page_table
        self._step_page_table = None
        start = time.perf_counter()
        n = len(rows)
        starts = np.asarray(starts)
        offsets = np.concatenate([[0], np.cumsum(np.asarray(seq_lens) - starts)])
        is_decode = isinstance(tokens, np.ndarray)
        mr = self.micro_rows
        packed_groups = []
        for a in range(0, n, mr):
            b = min(a + mr, n)
            group_slots = slots[offsets[a] : offsets[b]]
            batch = None
            parts: list[MetadataPart | None] = []
            if self.extensions:
                batch = StepBatch(
                    rows=rows[a:b],
                    starts=starts[a:b],
                    seq_lens=seq_lens[a:b],
                    slots=group_slots,
                    reqs=list(reqs[a:b]),
                    max_seqs=mr,
                    is_decode=is_decode,
                )
                parts = [ext.step_metadata(batch) for ext in self.extensions]
            flat, meta = self._micro_metadata.build(
                tokens=tokens[a:b],
                starts=starts[a:b],
                slots=group_slots,
                rows=rows[a:b],
                seq_lens=seq_lens[a:b],
                parts=parts,
            )
            src = None
            if self.overlap:
                src = np.full(flat.shape[0], -1, np.int32)
                if token_src is not None:
                    src[: b - a] = token_src[a:b]
            packed_groups.append((batch, flat, meta, src))
        prev = None
        if self.overlap:
            prev_tokens = self._inflight.next_tokens if self._inflight is not None else self._no_tokens
            prev = jax.device_put(prev_tokens, self._first_replicated)
        packed = time.perf_counter()
        pipe = self.pipeline
        pools = [pipe.pools(s) for s in range(pipe.pp_size)]
        pools[0] = self.cache.apply_pending()  # nothing is pending under pipelining (pipeline_cache)
        outs: list[tuple[Any, ...]] = []
        for _, flat, meta, src in packed_groups:
            x: Any = flat
            out: tuple[Any, ...] = ()
            for s, step in enumerate(self.stage_steps):
                if s:
                    x = jax.device_put(x, self.stage_replicated[s])  # to the next stage's devices
                    out = step(pools[s], self.stage_params[s], x, meta)
                else:
                    out = step(pools[0], self.stage_params[0], x, meta, prev, src)
                pools[s], x = out[0], out[1]
            outs.append(out)
        pad = self.micro_batches - len(outs)
        next_tokens = _in_order([o[1] for o in outs] + [self._pad_tokens] * pad)
        logits = None
        if self.record_logits:
            assert self._pad_logits is not None
            logits = _in_order([o[2] for o in outs] + [self._pad_logits] * pad)
        end = time.perf_counter()
        if self._copy_ahead:
            next_tokens.copy_to_host_async()
        for s in range(pipe.pp_size):
            pipe.set_pools(s, pools[s])
        for batch, _, _, _ in packed_groups:
            if batch is not None:
                for ext in self.extensions:
                    ext.after_step(batch)
        self.stats.pack_seconds += packed - start
        self.stats.step_seconds += end - packed
        return next_tokens, logits


def _in_order(parts: list[jax.Array]) -> jax.Array:
    """The micro-batches' outputs in batch order (one as it is)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
