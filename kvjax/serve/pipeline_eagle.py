"""EAGLE-style speculative decoding over pipeline stages (``--pp P --speculative-algorithm EAGLE``).

``pipeline_eagle_scheduler(spec, pipeline, params, draft_params=..., num_steps=k)`` is
``pipeline_stepping.pipeline_scheduler`` with a `PipelineEagleDecoding` proposer: the target runs
over the stages as without a draft, and the draft (DeepSeek's NextN layer, Qwen3-Next's MTP layer,
a Llama EAGLE head: ``speculative.nextn``) runs on the last stage, which holds the final norm, the
LM head and the target's final hidden states, as SGLang 0.5.23's PP + EAGLE worker places it
(``get_draft_kv_pool`` is the last PP rank's only). Its pool ``"kv_draft"`` is the last stage's
(``kvjax.plan.draft``: ``on_this_stage``), indexed by the same slots as every stage's KV (one
allocator, stage 0's, drives all), and so is EAGLE's hidden-state store (``[num_slots, hidden]``,
replicated over the last stage's devices).

* **prefill** (``PipelineStages.forward``, micro-batch by micro-batch): stages ``0 .. P - 2`` run
  their plain steps; the last stage's step is replaced by one program
  (``eagle_steps.after_target_prefill`` after the stage's layers): its layers, the head, the hidden
  states stored at the tokens' slots and the draft over the tokens (their ids moved to the last
  stage), writing its KV at the same slots.
* **decode**: a speculative round per running request, `EagleDecoding`'s (its allocation,
  acceptance, cut, rollback and finishing on the host; ``DraftDecoding._decode_round``), whose one
  round program is here three: the draft's ``k`` chained steps on the last stage
  (``eagle_steps.eagle_chain``) give the proposals and the verify tokens ``[t, d_1..d_k]`` per
  request; the tokens are moved to stage 0 and the target's forward of ``k + 1`` tokens per
  request runs through every stage (their plain stage steps, the verify metadata copied to each
  stage's devices); the last stage's program runs its layers and the head, stores the hidden
  states and re-runs the draft over the verified tokens (``eagle_steps.after_target_verify``).
  The host then accepts and rolls back as on one device: a rejected slot freed in the one
  allocator is freed on every stage and in the draft's pool at once (they share the slot ids);
  a kept slot's KV on every stage and the draft's are the verified tokens'.

Invariants: tokens are the target's greedy tokens alone (each stage computes what the one-device
target computes over the same KV); every stage's pools and the draft's pool are leak free with the
one allocator; the store and the draft's pool never leave the last stage's devices.

Recurrent state (Qwen3-Next with its MTP layer): a round's state is snapshotted on every stage
holding state and, for requests that rejected drafts, restored there and the kept tokens replayed
through every stage (``state_replay``; the replay is a prefill, so the draft's KV of the replayed
positions is rewritten from the target's states as after any prefill).

The rounds run as one micro-batch (the whole batch, the scheduler's metadata); prefill keeps the
stepping's micro-batches. Under overlap scheduling the prefills overlap as without a draft, but a
round is read before the next is launched (not chained on the device, as recurrent-state targets'
rounds on one device; kvjax's choice: the chained inputs would cross from the last stage to the
first each round). Not served over stages (refused by name before anything is built,
``kvjax.pipeline_check``): an EAGLE3 draft, a STANDALONE draft (SGLang refuses it with PP) and the
host tier with a draft.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import AttentionMetadata
from kvjax.build import KVCache
from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.causal_lm import PipelineStage, stage_params
from kvjax.serve.model import build_model, param_shapes
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import param_shardings, shard_params
from kvjax.serve.pipeline_cache import PipelineCache
from kvjax.serve.pipeline_retraction import stage_view
from kvjax.serve.pipeline_state import state_stages
from kvjax.serve.pipeline_stepping import PipelineStages, pipeline_scheduler
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.speculative.eagle import EagleDecoding
from kvjax.serve.speculative.eagle_steps import (
    after_target_prefill,
    after_target_verify,
    eagle_chain,
    nextn_draft_module,
)
from kvjax.serve.speculative.nextn import nextn_param_shapes
from kvjax.serve.speculative.state_replay import restore_states, snapshot_states
from kvjax.serve.step import _flat_shardings, pool_shardings
from kvjax.spec import ModelSpec

__all__ = ["PipelineEagleDecoding", "pipeline_eagle_scheduler"]


def pipeline_eagle_scheduler(
    spec: ModelSpec | ModelConfig,
    pipeline: PipelineCache,
    params: dict,
    *,
    draft_params: dict,
    num_steps: int,
    topk: int = 1,
    micro_batches: int = 1,
    **scheduler_args: Any,
) -> Scheduler:
    """A ``Scheduler`` over ``pipeline``'s stages decoding speculatively with the target's MTP
    layer or EAGLE head on the last stage (module docstring).

    ``pipeline``: built with ``CacheConfig(pp_size=P, speculative_algorithm="NEXTN" | "EAGLE",
    speculative_num_draft_tokens >= k + 1, ...)`` (its last stage holds ``"kv_draft"``);
    ``draft_params``: ``nextn.nextn_params`` (or ``eagle_head``'s); ``num_steps``: ``k``;
    ``topk``: 1. The rest as ``pipeline_scheduler`` (``overlap=True`` is refused: module docstring).
    """
    proposer = PipelineEagleDecoding(pipeline, draft_params, num_steps, topk=topk)
    proposer.check_cache(spec, pipeline.cache)
    return pipeline_scheduler(spec, pipeline, params, micro_batches=micro_batches, proposer=proposer, **scheduler_args)


class PipelineEagleDecoding(EagleDecoding):
    """`EagleDecoding` whose draft, draft pool and hidden-state store live on ``pipeline``'s last
    stage and whose verify forward runs through every stage (module docstring); the ``proposer``
    of a ``Scheduler`` stepped by ``PipelineStages`` over ``pipeline``."""

    def __init__(self, pipeline: PipelineCache, draft_params: dict, num_steps: int, *, topk: int = 1) -> None:
        super().__init__(draft_params, num_steps, topk=topk)
        self.pipeline = pipeline

    def _last_view(self) -> KVCache:
        return stage_view(self.pipeline, self.pipeline.pp_size - 1)

    def check_cache(self, spec: ModelSpec | ModelConfig, cache: KVCache) -> None:
        """`EagleDecoding.check_cache` of the last stage (its plan and pools hold the draft's)."""
        super().check_cache(spec, self._last_view())

    def check_scheduler(self, scheduler: Scheduler) -> ModelConfig:
        """`DraftDecoding.check_scheduler`, the rounds never chained on the device: under overlap
        each round is read before the next is launched (module docstring)."""
        target = super().check_scheduler(scheduler)
        self.chains = False
        return target

    def attach(self, scheduler: Scheduler) -> None:
        """Check the scheduler (`DraftDecoding.check_scheduler`), place the draft's
        weights and the store on the last stage's devices, replace the last stage's prefill step
        and compile the round's programs (module docstring)."""
        target = self.check_scheduler(scheduler)
        stepping = scheduler.stepping
        if not isinstance(stepping, PipelineStages) or stepping.pipeline is not self.pipeline:
            raise ConfigError(
                "stepping", type(stepping).__name__, "build the scheduler with pipeline_eagle_scheduler(pipeline, ...)"
            )
        pipe = self.pipeline
        last = pipe.pp_size - 1
        mesh = pipe.meshes[last]
        pools = pipe.pools(last)
        rep = NamedSharding(mesh, P())
        self.draft_params = shard_params(self.draft_params, target, mesh)
        self.hidden = jax.device_put(
            np.zeros((pools["kv_draft"].num_slots, target.hidden_size), np.dtype(target.dtype)), rep
        )
        pool_def, pool_leaves = _flat_shardings(pool_shardings(pools, mesh))
        programs = _last_stage_programs(
            target, pipe.stages[last], mesh, pool_def, pool_leaves, self.num_steps, scheduler.record_logits
        )
        prefill, chain, verify = programs
        put = [NamedSharding(m, P()) for m in pipe.meshes]

        def last_stage_prefill(pools: CachePools, params: Any, x: Any, tokens: Any, meta: Any) -> tuple[Any, ...]:
            out = prefill(pools, self.hidden, params, self.draft_params, x, jax.device_put(tokens, put[last]), meta)
            self.hidden = out[1]
            return (out[0], *out[2:])

        def run_round(
            pools0: CachePools,
            params0: Any,
            draft_params: Any,
            first: Any,
            draft_metas: AttentionMetadata,
            verify_meta: AttentionMetadata,
        ) -> tuple[Any, ...]:
            staged = [pools0, *(pipe.apply_pending(s, pipe.pools(s)) for s in range(1, last + 1))]
            on_last = jax.device_put((first, draft_metas, verify_meta), put[last])
            staged[last], proposals, tokens = chain(staged[last], self.hidden, draft_params, *on_last)
            x: Any = jax.device_put(tokens, put[0])
            for s in range(last):  # the verify forward of k + 1 tokens per request through the stages
                meta = jax.device_put(verify_meta, put[s])
                x = x if s == 0 else jax.device_put(x, put[s])
                staged[s], x = stepping.stage_steps[s](staged[s], stepping.stage_params[s], x, meta)
            x = jax.device_put(x, put[last])
            out = verify(staged[last], self.hidden, stepping.stage_params[last], draft_params, x, tokens, on_last[2])
            staged[last], self.hidden = out[0], out[1]
            for s in range(1, last + 1):
                scheduler.store_pools(staged[s], s)
            return (staged[0], proposals, *out[2:])

        stepping.last_stage = last_stage_prefill
        self._round = run_round

    # --- recurrent state: snapshot and restore on every stage holding state -------------------

    def _snapshot_states(self, s: Scheduler, pools: Any, slots: np.ndarray) -> Any:
        """Every state stage's recurrent state at ``slots`` before a round (its pending copies
        applied first; stage 0's from ``pools``)."""
        pipe = self.pipeline
        saved = {}
        for st in state_stages(pipe):
            if st == 0:
                stage_pools = pools
            else:
                stage_pools = pipe.apply_pending(st, pipe.pools(st))
                s.store_pools(stage_pools, st)
            saved[st] = snapshot_states(stage_pools.recurrent, slots)
        return saved

    def _restore_states(self, s: Scheduler, pools: Any, slots: np.ndarray, saved: Any, rows: np.ndarray) -> Any:
        """``saved`` rows ``rows`` written back at ``slots`` on every state stage; stage 0's pools
        (``pools``, donated) returned, the others stored."""
        pipe = self.pipeline
        for st, snapshot in saved.items():
            if st == 0:
                continue
            stage_pools = pipe.pools(st)
            s.store_pools(
                stage_pools.replace(recurrent=restore_states(stage_pools.recurrent, slots, snapshot, rows)), st
            )
        if 0 in saved:
            return pools.replace(recurrent=restore_states(pools.recurrent, slots, saved[0], rows))
        return pools


@functools.lru_cache(maxsize=8)
def _last_stage_programs(
    config: ModelConfig,
    stage: PipelineStage,
    mesh: Mesh,
    pool_def: Any,
    pool_leaves: tuple[NamedSharding, ...],
    num_steps: int,
    with_logits: bool,
) -> tuple[Any, Any, Any]:
    """The last stage's jitted ``(prefill, chain, verify)`` over its sub-mesh (module docstring),
    the pools (and the store, where written) donated, both models' weights split by
    ``param_sharding``'s rules, the rest replicated:

    * ``prefill(pools, store, params, draft_params, x, tokens, meta) -> (pools, store,
      next_tokens[, logits])``;
    * ``chain(pools, store, draft_params, first [S], draft_metas, verify_meta) -> (pools,
      proposals [S, k], tokens [T])``;
    * ``verify(pools, store, params, draft_params, x, tokens, verify_meta) -> (pools, store,
      greedy [S, k + 1][, logits])``.
    """
    target: Any = build_model(config).clone(stage=stage, return_hidden=True)
    module = nextn_draft_module(config)
    names = build_model(config).names
    weights = param_shardings(
        stage_params(param_shapes(config), stage, names, config.tie_word_embeddings), config, mesh
    )
    draft = param_shardings(nextn_param_shapes(config), config, mesh)
    pools = jax.tree.unflatten(pool_def, pool_leaves)
    rep = NamedSharding(mesh, P())
    logits_out = (rep,) if with_logits else ()

    def prefill(
        pools: CachePools, store: jax.Array, params: Any, draft_params: Any, x: jax.Array, tokens: jax.Array, meta: Any
    ) -> tuple[Any, ...]:
        logits, pools, hidden = target.apply({"params": params}, x, pools, meta)
        return after_target_prefill(module, draft_params, pools, store, tokens, meta, logits, hidden, with_logits)

    def chain(
        pools: CachePools, store: jax.Array, draft_params: Any, first: jax.Array, draft_metas: Any, verify_meta: Any
    ) -> tuple[Any, ...]:
        return eagle_chain(module, draft_params, pools, store, first, draft_metas, verify_meta)

    def verify(
        pools: CachePools, store: jax.Array, params: Any, draft_params: Any, x: jax.Array, tokens: jax.Array, meta: Any
    ) -> tuple[Any, ...]:
        logits, pools, hidden = target.apply({"params": params}, x, pools, meta)
        verified = (tokens, meta, logits, hidden, num_steps, with_logits)
        return after_target_verify(module, draft_params, pools, store, *verified)

    return (
        jax.jit(
            prefill,
            in_shardings=(pools, rep, weights, draft, rep, rep, rep),
            out_shardings=(pools, rep, rep, *logits_out),
            donate_argnums=(0, 1),
        ),
        jax.jit(
            chain,
            in_shardings=(pools, rep, draft, rep, rep, rep),
            out_shardings=(pools, rep, rep),
            donate_argnums=(0,),
        ),
        jax.jit(
            verify,
            in_shardings=(pools, rep, weights, draft, rep, rep, rep),
            out_shardings=(pools, rep, rep, *logits_out),
            donate_argnums=(0, 1),
        ),
    )
