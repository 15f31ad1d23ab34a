"""The pieces the recurrent mixers (Nemotron-H's Mamba2, Qwen3-Next's gated delta net) share, in
Hugging Face's parameter names: weights declared as stored (``Weight``, ``WeightAndBias``: a
projection's ``[out, in]``, the depthwise causal conv's ``conv1d.weight: [channels, 1, kernel]``
and optional ``conv1d.bias``, a norm's scale), the conv-then-SiLU of one token's window
(``conv_silu``), and the per-head decay parameters ``dt_bias`` and ``A_log``.

The recurrence itself (the state update, its inputs and outputs) differs per family and is the
``update`` function each family hands to ``kvjax.attention.recurrent_step``.

Both mixers run head-parallel (``kvjax.attention.recurrent_step.recurrent_mixer_over_heads``): they
declare their weights here, under Hugging Face's names, and apply them inside ``shard_map`` to each
rank's slices (``project``: the same product as ``kvjax.serve.layers.Linear``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.serve.layers import WEIGHT_INIT_STDDEV

__all__ = ["Weight", "WeightAndBias", "conv_silu", "decay_parameters", "project"]


class Weight(nn.Module):
    """One parameter named ``weight`` of ``shape`` (a projection's ``[out, in]``: normal with
    ``WEIGHT_INIT_STDDEV``, as ``Linear``; ``ones``: a norm's scale), returned as stored."""

    shape: tuple[int, ...]
    dtype: jnp.dtype
    ones: bool = False

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.initializers.ones if self.ones else nn.initializers.normal(WEIGHT_INIT_STDDEV)
        return self.param("weight", init, self.shape, self.dtype)


class WeightAndBias(nn.Module):
    """A layer's ``weight`` of ``shape`` (normal with ``WEIGHT_INIT_STDDEV``) and, with
    ``use_bias``, its ``bias: [shape[0]]`` (zeros), returned as stored (``None``: no bias)."""

    shape: tuple[int, ...]
    use_bias: bool
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array | None]:
        weight = self.param("weight", nn.initializers.normal(WEIGHT_INIT_STDDEV), self.shape, self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.shape[0],), self.dtype) if self.use_bias else None
        return weight, bias


def project(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x @ weight.T`` with ``weight: [out, in]`` (``Linear`` without a bias)."""
    return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())))


def conv_silu(window: jax.Array, weight32: jax.Array, bias32: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """``silu(sum_k window * weight (+ bias))`` for one token: ``window [channels, kernel]`` float32
    (the last ``kernel`` inputs, oldest first), the result ``[channels]`` rounded to ``dtype`` (the
    reference's activations) and returned in float32."""
    y = jnp.sum(window * weight32, axis=-1)
    if bias32 is not None:
        y = y + bias32
    return jax.nn.silu(y).astype(dtype).astype(jnp.float32)


def decay_parameters(module: nn.Module, heads: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """``(dt_bias [heads], A_log [heads])`` as parameters of ``module`` (call from its
    ``@nn.compact`` method): the time-step bias (starts at 1) and the log of the decay rate
    ``-exp(A_log)`` (starts at 0)."""
    dt_bias = module.param("dt_bias", nn.initializers.ones, (heads,), dtype)
    a_log = module.param("A_log", nn.initializers.zeros, (heads,), dtype)
    return dt_bias, a_log
