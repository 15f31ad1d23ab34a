"""The jitted steps of speculative serving, each with the pools donated (every KV write in place).

* ``make_paired_prefill_step``: the target's prefill forward and the draft's on the same tokens
  and metadata (the draft mirrors the target's prefill into ``"kv_draft"``, at the same slots);
  the scheduler's step signature ``step(pools, params, tokens, meta) -> (pools, next_tokens[,
  logits])`` with the draft's weights bound.
* ``make_round_step``: one speculative round in one dispatch: the draft's ``k + 1`` decode steps
  (``proposer.propose``), then the target's verify forward over ``[t, d_1, .., d_k]``
  (``verifier.verify``); returns ``(pools, proposals int32 [S, k], greedy int32 [S, k + 1])`` and,
  with logits, the target's float32 logits ``[S, k + 1, vocab]``. ``k`` and the token buckets are
  read from the metadata's shapes (one compile per batch shape).

Over a mesh (tensor parallelism: ``mesh`` and the pools as laid out, ``place_on_mesh``) both are
jitted with explicit shardings, as the plain sharded step is (``step.make_sharded_step``): the
pools in and out as they are laid out (donated, in place), the target's and the draft's weights
split Megatron style (``param_sharding``), everything else replicated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import AttentionMetadata
from kvjax.attention.sharding import serving_mesh
from kvjax.pools import CachePools
from kvjax.serve.model import build_model, param_shapes
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import param_shardings
from kvjax.serve.speculative.draft_view import draft_view, with_draft
from kvjax.serve.speculative.proposer import propose
from kvjax.serve.speculative.verifier import round_tokens, verify
from kvjax.serve.step import pool_shardings, step_body

__all__ = ["make_paired_prefill_step", "make_round_step", "paired_prefill_body", "round_body"]

StepFn = Callable[..., tuple[Any, ...]]


def make_paired_prefill_step(
    target: ModelConfig,
    draft: ModelConfig,
    draft_params: Any,
    *,
    with_logits: bool,
    mesh: Mesh | None = None,
    pools: CachePools | None = None,
) -> StepFn:
    """The scheduler's prefill step running the ``target`` model then the ``draft`` model (their
    serving configs; ``draft_params`` bound) on one batch; over ``mesh`` with ``pools``' layout
    (module docstring)."""
    jitted = _paired_prefill(target, draft, with_logits, *_layout(mesh, pools))

    def step(pools: CachePools, params: Any, tokens: Any, meta: AttentionMetadata, *overlap: Any) -> tuple[Any, ...]:
        # ``overlap``: the plain overlap inputs (previous tokens, token sources); a prefill's tokens
        # all come from the host (every source -1), so they are not read.
        return jitted(pools, params, draft_params, tokens, meta)

    return step


def _layout(mesh: Mesh | None, pools: CachePools | None) -> tuple[Any, Any, tuple[NamedSharding, ...]]:
    """``(mesh, pool tree, pool shardings)`` (hashable: the steps are cached by them), or Nones."""
    if mesh is None:
        return None, None, ()
    if pools is None:
        raise ValueError("a speculative step over a mesh needs the pools as laid out (place_on_mesh)")
    mesh = serving_mesh(mesh)
    leaves, treedef = jax.tree.flatten(pool_shardings(pools, mesh))
    return mesh, treedef, tuple(leaves)


def _jit(
    body: Callable[..., tuple[Any, ...]],
    configs: tuple[ModelConfig, ...],
    outputs: int,
    inputs: int,
    mesh: Mesh | None,
    pool_def: Any,
    pool_leaves: tuple[NamedSharding, ...],
) -> Any:
    """``body(pools, *weights of configs, *inputs)`` jitted with the pools donated; over ``mesh``
    with the pools' layout, each model's weights split by its rules, the rest replicated."""
    if mesh is None:
        return jax.jit(body, donate_argnums=0)
    pools = jax.tree.unflatten(pool_def, pool_leaves)
    weights = tuple(param_shardings(param_shapes(c), c, mesh) for c in configs)
    rep = NamedSharding(mesh, P())
    return jax.jit(
        body,
        in_shardings=(pools, *weights, *(rep,) * inputs),
        out_shardings=(pools, *(rep,) * outputs),
        donate_argnums=0,
    )


@functools.lru_cache(maxsize=8)
def _paired_prefill(
    target_config: ModelConfig,
    draft_config: ModelConfig,
    with_logits: bool,
    mesh: Mesh | None = None,
    pool_def: Any = None,
    pool_leaves: tuple[NamedSharding, ...] = (),
) -> Any:
    outputs = 2 if with_logits else 1
    body = paired_prefill_body(target_config, draft_config, with_logits=with_logits)
    return _jit(body, (target_config, draft_config), outputs, 2, mesh, pool_def, pool_leaves)


def paired_prefill_body(target_config: ModelConfig, draft_config: ModelConfig, *, with_logits: bool) -> StepFn:
    """The paired prefill un-jitted: ``body(pools, params, draft_params, tokens, meta) -> (pools,
    next_tokens[, logits])`` (module docstring), for a caller that wraps it in a program of its
    own (DP attention's ``shard_map`` over the ranks, ``kvjax.dp.speculative``)."""
    target: Any = build_model(target_config)
    draft: Any = build_model(draft_config)

    def body(
        pools: CachePools, params: Any, draft_params: Any, tokens: jax.Array, meta: AttentionMetadata
    ) -> tuple[Any, ...]:
        pools, *sampled = step_body(target, pools, params, tokens, meta, with_logits=with_logits)
        mirrored, _ = step_body(draft, draft_view(pools), draft_params, tokens, meta, sample=False)
        return (with_draft(pools, mirrored["kv"]), *sampled)

    return body


def make_round_step(
    target: ModelConfig,
    draft: ModelConfig,
    *,
    with_logits: bool,
    mesh: Mesh | None = None,
    pools: CachePools | None = None,
) -> Any:
    """``round(pools, params, draft_params, first_tokens [S], draft_metas, verify_meta)``: the
    module docstring's round, jitted with the pools donated (cached per pair of models and
    layout); over ``mesh`` with ``pools``' layout."""
    return _round_step(target, draft, with_logits, *_layout(mesh, pools))


@functools.lru_cache(maxsize=8)
def _round_step(
    target_config: ModelConfig,
    draft_config: ModelConfig,
    with_logits: bool,
    mesh: Mesh | None = None,
    pool_def: Any = None,
    pool_leaves: tuple[NamedSharding, ...] = (),
) -> Any:
    outputs = 3 if with_logits else 2
    body = round_body(target_config, draft_config, with_logits=with_logits)
    return _jit(body, (target_config, draft_config), outputs, 3, mesh, pool_def, pool_leaves)


def round_body(target_config: ModelConfig, draft_config: ModelConfig, *, with_logits: bool) -> StepFn:
    """The round un-jitted: ``body(pools, params, draft_params, first_tokens, draft_metas,
    verify_meta) -> (pools, proposals, greedy[, logits])`` (module docstring), for a caller that
    wraps it in a program of its own (``kvjax.dp.speculative``)."""
    target, draft = build_model(target_config), build_model(draft_config)

    def body(
        pools: CachePools,
        params: Any,
        draft_params: Any,
        first_tokens: jax.Array,
        draft_metas: AttentionMetadata,
        verify_meta: AttentionMetadata,
    ) -> tuple[Any, ...]:
        steps, draft_width = draft_metas.positions.shape
        k = steps - 1
        pools, proposals = propose(draft, draft_params, pools, first_tokens, draft_metas, draft_width)
        tokens = round_tokens(first_tokens, proposals[:k], verify_meta.positions.shape[0])
        pools, greedy, logits = verify(target, params, pools, tokens, verify_meta, k + 1)
        out = (pools, proposals[:k].T, greedy)
        return (*out, logits) if with_logits else out

    return body
