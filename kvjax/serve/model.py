"""The serving model: a Hugging Face-compatible decoder (flax) that reads and writes its cache
through kvjax's pools.

Every attention layer writes the new tokens' K and V into its pool and attends over the pages
through ``kvjax.attention.attend`` (the layer's kind picks the pool and the kernel), so a prefix
served from the radix cache is read from the very slots an earlier forward wrote.

The family (``ModelConfig.family``, an entry of ``kvjax.serve.families.FAMILIES``) picks the
module; weights are either a checkpoint's (``kvjax.serve.checkpoint.load_checkpoint``) or drawn
from a fixed seed (``init_params``, for presets such as the built-in ``tiny`` model: no downloads).

A forward takes one flat, ragged batch: ``T`` tokens of up to ``S`` sequences (``AttentionMetadata``)
and every device pool of the cache (``CachePools``: each layer uses the pool of its kind), and
returns float32 logits for the last token of each sequence only, and the new pools.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention import AttentionMetadata, trace_metadata
from kvjax.pools import CachePools
from kvjax.serve.families import family
from kvjax.serve.model_config import ModelConfig, model_config_from_spec
from kvjax.serve.trace_state import mha_trace_state
from kvjax.spec import ModelSpec

__all__ = [
    "AttentionMetadata",
    "BatchMetadata",
    "as_model_config",
    "build_model",
    "init_params",
    "mha_trace_state",
    "param_shapes",
    "trace_inputs",
]

Params = dict[str, Any]

BatchMetadata = AttentionMetadata
"""The former name of ``kvjax.attention.AttentionMetadata`` (an alias, kept for imports)."""


def as_model_config(model: ModelSpec | ModelConfig) -> ModelConfig:
    """A `ModelConfig` as is, or the one of a `ModelSpec` (in the spec's dtype)."""
    return model if isinstance(model, ModelConfig) else model_config_from_spec(model)


def build_model(model: ModelSpec | ModelConfig) -> nn.Module:
    """The flax module of the model's family."""
    config = as_model_config(model)
    return family(config.family).load("model")(config)


def trace_inputs(config: ModelConfig) -> tuple[jax.Array, CachePools, AttentionMetadata]:
    """One padding token on the smallest pools of the model's kinds: enough to trace the weights,
    which then do not depend on any cache the model is later used with."""
    entry = family(config.family)
    pools, part = entry.load("trace_state")(config) if entry.trace_state else mha_trace_state(config)
    meta = trace_metadata(part)
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
