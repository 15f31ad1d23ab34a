"""One pipeline stage's jitted step: its layers over its pools, on its own devices.

``make_stage_step(config, stage, mesh, pools)`` returns ``step(pools, params, x, meta, prev_tokens,
token_src)``, jitted over the stage's sub-mesh with the stage's pools donated (each KV write in
place on the stage's devices), its weights split over ``"tp"`` as ``kvjax.serve.param_sharding``
says, and everything else replicated on the stage's devices:

* the first stage takes the int32 tokens ``[T]`` as ``x`` (``prev_tokens`` / ``token_src`` as in
  ``kvjax.serve.step``: overlap scheduling's input ids still on the device) and embeds them;
  any other stage takes the previous stage's hidden states ``[T, hidden]``;
* every stage but the last returns ``(pools, hidden [T, hidden])``; the last returns
  ``(pools, next_tokens [S])`` or, ``with_logits``, ``(pools, next_tokens, logits [S, vocab])``
  (greedy sampling of the float32 logits, as the one-stage step).

The metadata is the same for every stage (the slots and page tables are the same on every stage,
only the layers behind them differ): the host packs it once per micro-batch and each stage's call
copies it to its own devices. ``place_stage(config, stage, mesh, pools, params)`` lays a stage's
pools and its weights (``causal_lm.stage_params``: only what it runs) out over its sub-mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from kvjax.attention import AttentionMetadata
from kvjax.pools import CachePools
from kvjax.serve.causal_lm import PipelineStage, StackNames, stage_params
from kvjax.serve.model import build_model, param_shapes
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import param_shardings
from kvjax.serve.step import StepFn, _flat_shardings, _jit_sharded, place_on_mesh, pool_shardings, step_body

__all__ = ["make_stage_step", "place_stage", "stage_module"]


def stage_module(config: ModelConfig, stage: PipelineStage) -> Any:
    """The family's flax model restricted to ``stage``'s layers (``CausalLM.stage``)."""
    return build_model(config).clone(stage=stage)


def _names(config: ModelConfig) -> StackNames:
    names = build_model(config).names
    assert isinstance(names, StackNames)
    return names


def place_stage(
    config: ModelConfig, stage: PipelineStage, mesh: Mesh, pools: CachePools, params: dict
) -> tuple[CachePools, dict]:
    """``(pools, weights)`` of ``stage`` laid out over its sub-mesh ``mesh``: the pools as built
    there (small arrays off the mesh replicated on it), the weights the stage runs
    (``stage_params`` of the whole model's ``params``) split over its ``"tp"`` axis."""
    own = stage_params(params, stage, _names(config), config.tie_word_embeddings)
    return place_on_mesh(config, pools, own, mesh)


def make_stage_step(
    config: ModelConfig, stage: PipelineStage, mesh: Mesh, pools: CachePools, *, with_logits: bool = False
) -> StepFn:
    """The jitted step of ``stage`` over its sub-mesh (module docstring); ``pools``: the stage's
    pools as they will be passed (``place_stage``). Cached per model, stage, mesh and pool layout."""
    pool_def, pool_leaves = _flat_shardings(pool_shardings(pools, mesh))
    return _make_stage_step(config, stage, mesh, pool_def, pool_leaves, with_logits)


@functools.lru_cache(maxsize=32)
def _make_stage_step(
    config: ModelConfig,
    stage: PipelineStage,
    mesh: Mesh,
    pool_def: Any,
    pool_leaves: tuple[NamedSharding, ...],
    with_logits: bool,
) -> StepFn:
    shapes = stage_params(param_shapes(config), stage, _names(config), config.tie_word_embeddings)
    weights = param_shardings(shapes, config, mesh)
    body = _stage_body(stage_module(config, stage), stage, with_logits)
    # the output structure: (pools, one replicated array[, another]) as the one-stage step's
    return _jit_sharded(body, mesh, weights, pool_def, pool_leaves, with_logits and stage.last)


def _stage_body(module: Any, stage: PipelineStage, with_logits: bool) -> Callable[..., tuple[Any, ...]]:
    def step(
        pools: CachePools,
        params: dict,
        x: jax.Array,
        meta: AttentionMetadata,
        prev_tokens: jax.Array | None = None,
        token_src: jax.Array | None = None,
    ) -> tuple[Any, ...]:
        future = (prev_tokens, token_src) if stage.first else (None, None)  # the ids enter at stage 0
        return step_body(module, pools, params, x, meta, *future, sample=stage.last, with_logits=with_logits)

    return step
