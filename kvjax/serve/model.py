"""The serving model: a Hugging Face-compatible decoder (flax) that reads and writes its cache
through kvjax's pools.

Every attention layer writes the new tokens' K and V into a paged pool (``MHAKVPool.set_kv_buffer``)
and attends over the pages through ragged paged attention
(``pallas_kernels.ragged_paged_attention``), so a prefix served from the radix cache is read from
the very slots an earlier forward wrote.

The family (``ModelConfig.family``, an entry of ``kvjax.serve.families.FAMILIES``) picks the
module; weights are either a checkpoint's (``kvjax.serve.checkpoint.load_checkpoint``) or drawn
from a fixed seed (``init_params``, for presets such as the built-in ``tiny`` model: no downloads).

A forward takes one flat, ragged batch: ``T`` tokens of up to ``S`` sequences (``BatchMetadata``)
and every device pool of the cache (``CachePools``: each layer uses the pool of its kind), and
returns float32 logits for the last token of each sequence only, and the new pools.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.pools import CachePools, MHAKVPool
from kvjax.serve.families import family
from kvjax.serve.layers import BatchMetadata
from kvjax.serve.model_config import ModelConfig, model_config_from_spec
from kvjax.spec import ModelSpec

__all__ = ["BatchMetadata", "as_model_config", "build_model", "init_params", "param_shapes", "trace_inputs"]

Params = dict[str, Any]


def as_model_config(model: ModelSpec | ModelConfig) -> ModelConfig:
    """A `ModelConfig` as is, or the one of a `ModelSpec` (in the spec's dtype)."""
    return model if isinstance(model, ModelConfig) else model_config_from_spec(model)


def build_model(model: ModelSpec | ModelConfig) -> nn.Module:
    """The flax module of the model's family."""
    config = as_model_config(model)
    return family(config.family).load("model")(config)


def mha_trace_state(config: ModelConfig) -> tuple[CachePools, dict[str, Any]]:
    """A one-page MHA pool of the model's shape and no extras (the default ``Family.trace_state``)."""
    kv = MHAKVPool.create(
        num_pages=1,
        page_size=1,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        v_head_dim=config.head_dim,
        dtype=config.dtype,
    )
    return CachePools(kv=kv), {}


def trace_inputs(config: ModelConfig) -> tuple[jax.Array, CachePools, BatchMetadata]:
    """One padding token on the smallest pools of the model's kinds: enough to trace the weights,
    which then do not depend on any cache the model is later used with."""
    entry = family(config.family)
    pools, extras = entry.load("trace_state")(config) if entry.trace_state else mha_trace_state(config)
    meta = BatchMetadata(
        positions=jnp.zeros((1,), jnp.int32),
        out_loc=jnp.zeros((1,), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32),
        page_indices=jnp.zeros((1, 1), jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
        logits_indices=jnp.zeros((1,), jnp.int32),
        extras=extras,
    )
    return jnp.zeros((1,), jnp.int32), pools, meta


@functools.lru_cache(maxsize=8)
def init_params(model: ModelSpec | ModelConfig, *, seed: int = 0) -> Params:
    """Random weights drawn from a fixed seed (normal, std 0.02; norms 1; biases 0), cached per
    ``(model, seed)``."""
    config = as_model_config(model)
    return build_model(config).init(jax.random.key(seed), *trace_inputs(config))["params"]


@functools.lru_cache(maxsize=8)
def param_shapes(config: ModelConfig) -> Params:
    """The parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
    module = build_model(config)
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *trace_inputs(config)))["params"]
