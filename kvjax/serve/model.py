"""The serving model: a Hugging Face-compatible decoder (flax) that reads and writes its KV through
kvjax's pool.

Every layer writes the new tokens' K and V into the paged pool (``MHAKVPool.set_kv_buffer``) and
attends over the pages through ragged paged attention (``pallas_kernels.ragged_paged_attention``),
so a prefix served from the radix cache is read from the very slots an earlier forward wrote.

The family (``ModelConfig.family``) picks the module (``MODEL_CLASSES``); weights are either a
checkpoint's (``kvjax.serve.checkpoint.load_checkpoint``) or drawn from a fixed seed
(``init_params``, for presets such as the built-in ``tiny`` model: no downloads).

A forward takes one flat, ragged batch: ``T`` tokens of up to ``S`` sequences (``BatchMetadata``)
and returns float32 logits for the last token of each sequence only, and the new pool.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.pools import MHAKVPool
from kvjax.serve.families.llama import LlamaForCausalLM
from kvjax.serve.families.qwen3 import Qwen3ForCausalLM
from kvjax.serve.layers import BatchMetadata
from kvjax.serve.model_config import ModelConfig, model_config_from_spec
from kvjax.spec import ModelSpec

__all__ = ["MODEL_CLASSES", "BatchMetadata", "as_model_config", "build_model", "init_params", "param_shapes"]

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

Params = dict[str, Any]


def as_model_config(model: ModelSpec | ModelConfig) -> ModelConfig:
    """A `ModelConfig` as is, or the one of a `ModelSpec` (in the spec's dtype)."""
    return model if isinstance(model, ModelConfig) else model_config_from_spec(model)


def build_model(model: ModelSpec | ModelConfig) -> nn.Module:
    """The flax module of the model's family."""
    config = as_model_config(model)
    return MODEL_CLASSES[config.family](config)


def _trace_inputs(config: ModelConfig) -> tuple[jax.Array, MHAKVPool, BatchMetadata]:
    """One padding token on a one-page pool of the model's shape: enough to trace the weights,
    which then do not depend on any cache the model is later used with."""
    kv = MHAKVPool.create(
        num_pages=1,
        page_size=1,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        v_head_dim=config.head_dim,
        dtype=config.dtype,
    )
    meta = BatchMetadata(
        positions=jnp.zeros((1,), jnp.int32),
        out_loc=jnp.zeros((1,), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32),
        page_indices=jnp.zeros((1, 1), jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
        logits_indices=jnp.zeros((1,), jnp.int32),
    )
    return jnp.zeros((1,), jnp.int32), kv, meta


@functools.lru_cache(maxsize=8)
def init_params(model: ModelSpec | ModelConfig, *, seed: int = 0) -> Params:
    """Random weights drawn from a fixed seed (normal, std 0.02; norms 1; biases 0), cached per
    ``(model, seed)``."""
    config = as_model_config(model)
    return build_model(config).init(jax.random.key(seed), *_trace_inputs(config))["params"]


@functools.lru_cache(maxsize=8)
def param_shapes(config: ModelConfig) -> Params:
    """The parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
    module = build_model(config)
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *_trace_inputs(config)))["params"]
