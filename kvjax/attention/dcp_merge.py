"""Merging attention computed over disjoint key sets with their log-sum-exp (decode context parallelism).

Each DCP rank attends a query over its own stripe of the keys and returns the normalised partial
output ``o_r`` and the log-sum-exp of its logits ``lse_r`` (``-inf`` where it sees no key). The
attention over all keys is exactly

    m = max_r lse_r,    w_r = exp(lse_r - m),    o = sum_r w_r o_r / sum_r w_r

(softmax is a ratio of sums, and each rank's sum is ``exp(lse_r)``). An attention-sink logit
``s`` (gpt-oss) belongs to no rank: it joins the maximum and adds ``exp(s - m)`` to the
denominator once. Everything is float32.

:func:`merge_over_axis` runs
inside ``jax.shard_map`` and merges over a mesh axis with one ``pmax`` and two ``psum``
collectives (of ``[T, heads]`` and ``[T, heads, head_dim]``; XLA combines the two ``psum``);
:func:`merge_scattered_over_axis` is the same merge ending in reduce-scatters over the head axis
(each rank keeps its own block of heads, as under DCP carved out of the TP group);
:func:`merge_stacked` merges partials stacked on a leading axis on one device (the same
arithmetic: what the single-device tests compare against).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["merge_over_axis", "merge_scattered_over_axis", "merge_stacked"]

_Reduce = Callable[[jax.Array], jax.Array]


def _merge(
    out: jax.Array, lse: jax.Array, sinks: jax.Array | None, reduce_max: _Reduce, reduce_sum: _Reduce
) -> jax.Array:
    """The merge of the module docstring with the reductions over ranks given."""
    peak = reduce_max(lse)
    if sinks is not None:
        peak = jnp.maximum(peak, sinks[None, :])
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # no key anywhere (padding): weights all 0
    weight = jnp.where(jnp.isfinite(lse), jnp.exp(lse - peak), 0.0)
    numer = reduce_sum(weight[..., None] * out)
    denom = reduce_sum(weight)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[None, :] - peak)
    return numer / jnp.where(denom > 0, denom, 1.0)[..., None]


def merge_over_axis(out: jax.Array, lse: jax.Array, axis: str, *, sinks: jax.Array | None = None) -> jax.Array:
    """Merge this rank's partial attention with every rank's along mesh axis ``axis`` (inside
    ``shard_map``).

    Args:
        out: float32 ``[T, heads, head_dim]``: this rank's normalised output over its keys (0 where
            it sees none).
        lse: float32 ``[T, heads]``: the log-sum-exp of its logits (``-inf`` where it sees none).
        axis: the mesh axis the ranks lie along (``"dcp"``).
        sinks: float32 ``[heads]`` attention-sink logits, or None.

    Returns:
        float32 ``[T, heads, head_dim]``, the same on every rank of ``axis``.
    """
    return _merge(
        out,
        lse,
        sinks,
        lambda x: jax.lax.pmax(x, axis),
        lambda x: jax.lax.psum(x, axis),
    )


def merge_scattered_over_axis(
    out: jax.Array, lse: jax.Array, axis: str, *, sinks: jax.Array | None = None
) -> jax.Array:
    """:func:`merge_over_axis` where each rank keeps only its block of the heads: rank ``r`` of the
    ``n`` along ``axis`` gets heads ``r * heads / n ..`` of the merged output, through one
    ``pmax`` of ``[T, heads]`` and two reduce-scatters (``psum_scatter``) instead of ``psum``.

    Args:
        out, lse: as :func:`merge_over_axis` (every rank the same ``heads``; ``n`` divides them).
        axis: the mesh axis the ranks lie along (``"dcp"``).
        sinks: float32 ``[heads]`` attention-sink logits of all the heads, or None.

    Returns:
        float32 ``[T, heads / n, head_dim]``: this rank's heads of the attention over all keys.
    """
    ranks = jax.lax.axis_size(axis)
    heads = out.shape[1]
    own = heads // ranks
    start = jax.lax.axis_index(axis) * own
    peak = jax.lax.pmax(lse, axis)
    if sinks is not None:
        peak = jnp.maximum(peak, sinks[None, :])
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # no key anywhere (padding): weights all 0
    weight = jnp.where(jnp.isfinite(lse), jnp.exp(lse - peak), 0.0)
    numer = jax.lax.psum_scatter(weight[..., None] * out, axis, scatter_dimension=1, tiled=True)
    denom = jax.lax.psum_scatter(weight, axis, scatter_dimension=1, tiled=True)
    if sinks is not None:
        own_peak = jax.lax.dynamic_slice_in_dim(peak, start, own, axis=1)
        own_sinks = jax.lax.dynamic_slice_in_dim(sinks, start, own, axis=0)
        denom = denom + jnp.exp(own_sinks[None, :] - own_peak)
    return numer / jnp.where(denom > 0, denom, 1.0)[..., None]


def merge_stacked(out: jax.Array, lse: jax.Array, *, sinks: jax.Array | None = None) -> jax.Array:
    """Merge partials stacked on a leading rank axis: ``out [R, T, heads, head_dim]``, ``lse
    [R, T, heads]`` (float32) -> ``[T, heads, head_dim]``."""
    return _merge(
        out,
        lse,
        sinks,
        lambda x: jnp.max(x, axis=0),
        lambda x: jnp.sum(x, axis=0),
    )
