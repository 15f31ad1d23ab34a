"""One layer's write-then-attend over a pool striped over decode-context-parallel (DCP) ranks.

Under DCP the mesh is ``("tp", "dcp")`` (``kvjax.mesh_check``: DCP divides the TP group): the
pool's KV heads (or its whole latent row) lie over ``"tp"``, each request's tokens are striped over
``"dcp"``, and the query heads over both axes jointly, tp-major (``query_spec``), as the weights
that make them (``kvjax.serve.param_sharding``). What ``dcp_attention`` (K/V pages) and
``dcp_mla_attention`` (latent rows) share:

* the partial attention each rank runs over its rows (given by the caller): the ragged paged
  attention kernels with ``key_stride=dcp`` and ``key_offset=rank`` (local key ``l`` of rank ``r``
  is the sequence's position ``l * dcp + r``), returning their log-sum-exp;
* ``query_spec`` / ``check_query_heads``: the query heads over ``("tp", "dcp")``;
* ``run_striped_layer``: one ``jax.shard_map`` over the mesh in which each rank writes the rows it
  owns (``DCPStripe.owner``; the others go to its trash page, so every token is stored once),
  all-gathers over ``"dcp"`` the query heads of its ``"tp"`` rank's KV heads, attends them over its
  stripe, and merges the partials exactly over ``"dcp"`` with their log-sum-exp, each rank keeping
  its own heads (``dcp_merge.merge_scattered_over_axis``: reduce-scatters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.alloc.dcp import DCPStripe
from kvjax.attention.dcp_merge import merge_scattered_over_axis
from kvjax.mesh_check import KV_HEAD_AXIS
from kvjax.pools import MHAKVPool, MLAKVPool, dtypes
from kvjax.pools.base import route_to_trash
from kvjax.pools.mla import scatter_rows
from pallas_kernels.kv_write import write_kv

__all__ = ["check_query_heads", "query_spec", "run_striped_layer"]

StripedPool = TypeVar("StripedPool", MHAKVPool, MLAKVPool)
RowWriter = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (layer, rows, local slots) -> layer


def query_spec(axis: str) -> P:
    """The spec of a ``[T, heads, dim]`` query under DCP over mesh axis ``axis``: heads over
    ``("tp", axis)`` jointly, tp-major (the weights' split)."""
    return P(None, (KV_HEAD_AXIS, axis), None)


def check_query_heads(what: str, heads: int, mesh: Mesh, axis: str) -> None:
    """``ValueError`` naming ``what`` when ``heads`` do not split over the ``"tp"`` and ``axis``
    devices jointly (the whole TP group)."""
    missing = [name for name in (KV_HEAD_AXIS, axis) if name not in mesh.axis_names]
    if missing:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)}; DCP attention shards over ('tp', {axis!r})")
    ranks = int(mesh.shape[KV_HEAD_AXIS]) * int(mesh.shape[axis])
    if heads % ranks:
        raise ValueError(f"{what}: {heads} heads do not split over the mesh's {ranks} devices (the TP group)")


def _layer_layout(pool: MHAKVPool | MLAKVPool, axis: str) -> tuple[RowWriter, P, P]:
    """``(write_rows, layer_spec, packed_spec)`` of a striped pool's layer: K/V pages split over
    the DCP axis (rows) and the KV-head axis, written as K/V pairs; or latent rows split over the
    DCP axis only, the batch's rows replicated."""
    if isinstance(pool, MHAKVPool):
        heads_axis = pool.kv_head_axis
        return write_kv, P(None, axis, heads_axis, None), P(None, heads_axis, None)
    return scatter_rows, P(None, axis, None), P()


def run_striped_layer(
    pool: StripedPool,
    index: int,
    mesh: Mesh,
    attend_stripe: Callable[..., tuple[jax.Array, jax.Array]],
    packed: jax.Array,
    out_loc: jax.Array,
    queries: tuple[jax.Array, ...],
    metadata: tuple[jax.Array, ...],
    scales: dict[str, jax.Array],
    sinks: tuple[jax.Array, P] | None = None,
) -> tuple[jax.Array, StripedPool]:
    """Write, attend and merge layer ``index`` of ``pool`` inside one ``jax.shard_map`` (module
    docstring). The pool is striped over ``mesh``'s axis ``pool.context_axis``.

    Args:
        attend_stripe: ``attend_stripe(*queries, kv, *metadata, rank=rank, **scales) -> (out,
            lse)``: the rank's float32 partial attention over ``kv``, its rows of the layer in the
            logical dtype (``striped_partial_attention``, ``striped_partial_mla_attention``).
        packed: the batch's rows to write, in storage form ``[T, ...]``.
        out_loc: int32 ``[T]`` global (striped) slots of ``packed``; invalid ones go to the trash.
        queries: the query arrays ``[T, heads, ...]``, their heads split over ``("tp", axis)``
            (``query_spec``); the output has the first one's dtype and the same split.
        metadata, scales: the batch's metadata in global terms and the layer's dequantisation
            scales, on every rank.
        sinks: float32 attention-sink logits of every query head and their spec over ``"tp"``
            (the heads a ``"tp"`` rank gathers), joined to the merge once; or None.

    Returns:
        ``(out, pool)``: the attention over the whole sequence, and the pool with the batch's rows
        written on their owners.
    """
    axis = pool.context_axis
    if axis is None:
        raise ValueError(f"layer index {index}'s pool is not striped over a DCP axis")
    dcp = int(mesh.shape[axis])
    stripe = DCPStripe(pool.page_size // dcp, dcp)
    write_rows, layer_spec, packed_spec = _layer_layout(pool, axis)
    heads_spec = query_spec(axis)
    sink_args = () if sinks is None else (sinks[0],)
    specs = (layer_spec, packed_spec, P(), heads_spec, P(), P(), *(() if sinks is None else (sinks[1],)))

    def step(
        layer: jax.Array,
        packed: jax.Array,
        slots: jax.Array,
        queries: tuple[jax.Array, ...],
        metadata: tuple[jax.Array, ...],
        scales: dict[str, jax.Array],
        *sink: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        rank = jax.lax.axis_index(axis)
        owned = jnp.where(stripe.owner(slots) == rank, stripe.local_slot(slots), 0)  # others: the trash page
        layer = write_rows(layer, packed, owned)
        kv = dtypes.from_storage(layer, pool.logical_dtype)
        gathered = tuple(jax.lax.all_gather(q, axis, axis=1, tiled=True) for q in queries)  # the tp rank's heads
        out, lse = attend_stripe(*gathered, kv, *metadata, rank=rank, **scales)
        merged = merge_scattered_over_axis(out, lse, axis, sinks=sink[0] if sink else None)
        return layer, merged.astype(queries[0].dtype)

    run = jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(layer_spec, heads_spec), check_vma=False)
    slots = route_to_trash(out_loc, pool.num_slots)
    layer, out = run(pool.kv[index], packed, slots, queries, metadata, scales, *sink_args)
    return out, pool.with_layer(index, layer)
