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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.attention import AttentionMetadata
from kvjax.pools import CachePools
from kvjax.serve.model import as_model_config, build_model
from kvjax.serve.model_config import ModelConfig
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

    def step(
        pools: CachePools,
        params: dict,
        tokens: jax.Array,
        meta: AttentionMetadata,
        prev_tokens: jax.Array | None = None,
        token_src: jax.Array | None = None,
    ) -> tuple[Any, ...]:
        if token_src is not None and prev_tokens is not None:
            tokens = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], tokens)
        logits, new_pools = module.apply({"params": params}, tokens, pools, meta)
        next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (new_pools, next_tokens, logits) if with_logits else (new_pools, next_tokens)

    return jax.jit(step, donate_argnums=0)
