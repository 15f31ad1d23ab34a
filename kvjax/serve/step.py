"""The jitted serving step: one forward of a ragged batch with the pools donated, greedy sampling.

``make_step(model)`` returns ``step(pools, params, tokens, meta) -> (pools, next_tokens)``; with
``with_logits=True`` it returns ``(pools, next_tokens, logits)`` (``[S, vocab]`` float32). The
pools are donated, so every KV write happens in place; the host reads back ``next_tokens`` (one
int32 per sequence row) and, only when asked, the logits.

Future tokens (overlap scheduling): ``step(pools, params, tokens, meta, prev_tokens, token_src)``
takes input ids that an earlier step sampled and the host has not read yet. ``prev_tokens`` is
that step's ``next_tokens`` (a device array, ``[S]``), ``token_src`` int32 ``[T]`` (the token
bucket): where ``token_src[i] >= 0`` the input id of token ``i`` is ``prev_tokens[token_src[i]]``,
gathered on the device; where it is ``-1``, ``tokens[i]`` (from the host).

The step's inputs (``tokens`` and ``meta``, an ``AttentionMetadata``) are packed on the host by
``kvjax.attention.MetadataBuilder`` with fixed shapes, as numpy arrays.

Over a mesh (tensor parallelism): ``make_sharded_step(model, mesh, pools)`` jits the same step
with explicit shardings: the pools in and out as they are laid out (KV heads over ``"tp"``, the
pools donated, so each write stays in place on its device), the weights as
``kvjax.serve.param_sharding`` splits them, the tokens, metadata and outputs replicated. Place the
state first with ``place_on_mesh`` (pools and weights); XLA inserts the collectives
(``param_sharding``'s docstring says which).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention import AttentionMetadata
from kvjax.attention.sharding import serving_mesh
from kvjax.pools import CachePools
from kvjax.serve.model import as_model_config, build_model, param_shapes
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.param_sharding import param_shardings, shard_params
from kvjax.spec import ModelSpec

StepFn = Callable[..., tuple[Any, ...]]


def make_step(model: ModelSpec | ModelConfig, *, with_logits: bool = False) -> StepFn:
    """The model's forward plus greedy sampling, jitted with the pools donated.

    Cached per model config, so schedulers of the same model share compiled code.
    """
    return _make_step(as_model_config(model), with_logits)


@functools.cache
def _make_step(config: ModelConfig, with_logits: bool) -> StepFn:
    return make_module_step(build_model(config), with_logits=with_logits)


def make_module_step(module: Any, *, with_logits: bool = False) -> StepFn:
    """``make_step`` for a model of the caller's own: ``module`` is a flax module (any object with
    ``apply({"params": params}, tokens, pools, meta) -> (logits [S, vocab], new_pools)``: int32
    ``tokens [T]``, the cache's ``CachePools`` and the batch's ``BatchMetadata``; it returns every
    pool, updated). Not cached: keep the returned step to reuse its compiled code."""
    return jax.jit(_step_body(module, with_logits), donate_argnums=0)


def step_body(
    module: Any,
    pools: CachePools,
    params: Any,
    tokens: jax.Array,
    meta: AttentionMetadata,
    prev_tokens: jax.Array | None = None,
    token_src: jax.Array | None = None,
    *,
    sample: bool = True,
    with_logits: bool = False,
) -> tuple[Any, ...]:
    """The one serving step body (inside jit), every step builder's: the future input ids
    gathered (overlap: ``future_tokens``, when ``prev_tokens`` and ``token_src`` are given),
    ``module`` applied to ``(tokens, pools, meta)`` and, with ``sample``, greedy sampling.

    Returns ``(new_pools, next_tokens [S])`` (``with_logits``: ``(new_pools, next_tokens,
    logits)``), or without ``sample`` ``(new_pools, out)`` with the module's output as it is (a
    pipeline stage's hidden states). The single-rank step, every DP rank inside the DP step, each
    pipeline stage and the speculative paired prefill run this body.
    """
    if token_src is not None and prev_tokens is not None:
        tokens = future_tokens(tokens, prev_tokens, token_src)
    out, new_pools = module.apply({"params": params}, tokens, pools, meta)
    if not sample:
        return new_pools, out
    next_tokens = jnp.argmax(out, axis=-1).astype(jnp.int32)
    return (new_pools, next_tokens, out) if with_logits else (new_pools, next_tokens)


def _step_body(module: Any, with_logits: bool) -> Callable[..., tuple[Any, ...]]:
    """The step as a plain function (not jitted) of ``module``: ``step_body`` taking ``(pools,
    params, tokens, meta, prev_tokens=None, token_src=None)`` positionally, as the jitted programs
    take them."""
    return functools.partial(step_body, module, with_logits=with_logits)


def pool_shardings(pools: CachePools, mesh: Mesh) -> Any:
    """The sharding of every pool array over ``mesh``: its own when laid out over the mesh (KV
    heads over ``"tp"``, a replicated latent), else replicated (small per-layer scales)."""

    def sharding(leaf: Any) -> NamedSharding:
        own = getattr(leaf, "sharding", None)
        if isinstance(own, NamedSharding) and own.mesh == mesh:
            return own
        return NamedSharding(mesh, P())

    return jax.tree.map(sharding, pools)


def place_on_mesh(
    model: ModelSpec | ModelConfig | None, pools: CachePools, params: Any, mesh: Mesh
) -> tuple[CachePools, Any]:
    """``(pools, params)`` laid out over ``mesh`` as ``make_sharded_step`` expects: pool arrays
    that are not on the mesh replicated there, the weights re-laid out and split by
    ``param_sharding.shard_params`` (or, with ``model`` None, a model of the caller's own, kept as
    placed when already on the mesh, else replicated). ``mesh`` is used with ``Auto`` axes
    (``serving_mesh``)."""
    mesh = serving_mesh(mesh)
    pools = jax.device_put(pools, pool_shardings(pools, mesh))
    if model is not None:  # re-laid out where a rule says (param_sharding.relayout_params), then split
        return pools, shard_params(params, as_model_config(model), mesh)
    return pools, jax.device_put(params, pool_shardings(params, mesh))


def make_sharded_step(
    model: ModelSpec | ModelConfig,
    mesh: Mesh,
    pools: CachePools,
    *,
    with_logits: bool = False,
    module: Any = None,
    params: Any = None,
) -> StepFn:
    """``make_step`` over ``mesh``, jitted with explicit shardings (module docstring): ``pools``
    (laid out as they will be passed; ``place_on_mesh``) give the pools' in and out shardings, the
    weights follow ``kvjax.serve.param_sharding`` (or, with ``module``, a model of the caller's
    own, ``params``' own layout), everything else is replicated. Cached per model, mesh and pool
    layout."""
    mesh = serving_mesh(mesh)
    pool_def, pool_leaves = _flat_shardings(pool_shardings(pools, mesh))
    if module is not None:
        if params is None:
            raise ValueError("a model of the caller's own needs its params to lay the step out")
        weights = pool_shardings(params, mesh)
        return _jit_sharded(_step_body(module, with_logits), mesh, weights, pool_def, pool_leaves, with_logits)
    return _make_sharded_step(as_model_config(model), mesh, pool_def, pool_leaves, with_logits)


def _flat_shardings(tree: Any) -> tuple[Any, tuple[NamedSharding, ...]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaves)


@functools.lru_cache(maxsize=16)
def _make_sharded_step(
    config: ModelConfig, mesh: Mesh, pool_def: Any, pool_leaves: tuple[NamedSharding, ...], with_logits: bool
) -> StepFn:
    weights = param_shardings(param_shapes(config), config, mesh)
    return _jit_sharded(_step_body(build_model(config), with_logits), mesh, weights, pool_def, pool_leaves, with_logits)


def _jit_sharded(
    body: Callable[..., tuple[Any, ...]],
    mesh: Mesh,
    weights: Any,
    pool_def: Any,
    pool_leaves: tuple[NamedSharding, ...],
    with_logits: bool,
) -> StepFn:
    pools = jax.tree.unflatten(pool_def, pool_leaves)
    rep = NamedSharding(mesh, P())
    outs = (pools, rep, rep) if with_logits else (pools, rep)
    # tokens, meta (a prefix: every leaf), prev_tokens, token_src: replicated.
    jitted = jax.jit(body, in_shardings=(pools, weights, rep, rep, rep, rep), out_shardings=outs, donate_argnums=0)
    return positional_step(jitted)


def future_tokens(tokens: jax.Array, prev_tokens: jax.Array, token_src: jax.Array) -> jax.Array:
    """The step's input ids under overlap scheduling (inside jit): ``prev_tokens[token_src[i]]``
    where ``token_src[i] >= 0`` (the previous step's output, still on the device), else
    ``tokens[i]`` (a host id)."""
    return jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], tokens)


def positional_step(jitted: Any) -> StepFn:
    """``step(pools, params, tokens, meta, prev_tokens=None, token_src=None)`` over a jitted
    program of those six arguments, each passed positionally (the in-shardings are positional);
    ``step.jitted`` is the program, for ``.lower(...)`` (six arguments)."""

    def step(
        pools: CachePools,
        params: Any,
        tokens: Any,
        meta: AttentionMetadata,
        prev_tokens: jax.Array | None = None,
        token_src: Any = None,
    ) -> tuple[Any, ...]:
        return jitted(pools, params, tokens, meta, prev_tokens, token_src)

    step.jitted = jitted  # type: ignore[attr-defined]
    return step
