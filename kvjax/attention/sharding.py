"""Running an attention kernel per device when the pool is sharded over its KV-head axis.

Pallas kernels are not partitioned automatically: over a mesh, a kernel runs inside
``jax.shard_map`` on each device's slice. The query's head axis and the pool's combined K/V head
axis are sharded over the mesh's KV-head axis (``"tp"``, ``kvjax.mesh_check.KV_HEAD_AXIS``); the
metadata and scales are replicated. Each device holds whole KV heads (K and V of head ``h`` are
adjacent, ``kvjax.pools.mha``) and the query heads of a GQA group are contiguous
(``q head i`` reads ``kv head i // group``), so contiguous blocks of both line up. With no mesh
the kernel is called as is.

Axis types: the serving mesh has ``Auto`` axes (``serving_mesh``). ``jax.make_mesh`` makes
``Explicit`` ones, under which every array's type carries its sharding and a ``shard_map`` refuses
an input laid out otherwise; with ``Auto`` axes XLA (GSPMD) places the activations and inserts the
collectives between the sharded weights and the per-device kernels (``kvjax.serve.param_sharding``).

KV heads over more ranks than the model has (``tp > kv_heads``, ``tp % kv_heads == 0``): as in
SGLang, each rank holds one KV head, so every head is stored ``tp / kv_heads`` times; the pool's
global head axis has ``tp`` heads (rank ``r`` holds the model's head ``r // (tp / kv_heads)``)
and ``expand_kv_heads`` repeats the model's K/V heads to match before the write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.mesh_check import KV_HEAD_AXIS

__all__ = [
    "check_heads_divide",
    "expand_kv_heads",
    "head_axis",
    "pool_mesh",
    "pools_mesh",
    "serving_mesh",
    "sharded_over_heads",
]


def serving_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis ``Auto`` (the same devices and names); ``mesh`` itself when it
    already is. See the module docstring for why serving needs ``Auto`` axes."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def pools_mesh(pools: Any) -> Mesh | None:
    """The mesh the pools' arrays are laid out over (the first ``NamedSharding`` found among the
    leaves of ``pools``), or None when they live on one device."""
    for leaf in jax.tree.leaves(pools):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def expand_kv_heads(x: jax.Array, pool_heads: int, what: str) -> jax.Array:
    """``x [T, heads, d]`` with each head repeated ``pool_heads / heads`` times (adjacent copies),
    for a pool whose heads are replicated over more ranks than the model has KV heads; ``x`` as is
    when the counts are equal. ``ValueError`` naming ``what`` when ``pool_heads`` is not a
    multiple of the model's heads."""
    heads = x.shape[1]
    if heads == pool_heads:
        return x
    if heads == 0 or pool_heads % heads:
        raise ValueError(f"{what} has {heads} KV heads; the pool holds {pool_heads} (per rank x ranks), not a multiple")
    return jnp.repeat(x, pool_heads // heads, axis=1)


def pool_mesh(pool: Any, mesh: Mesh | None) -> Mesh | None:
    """The mesh to run on: ``mesh`` when given, else the pool's own (``pool.mesh``, set when its
    layers were created sharded), else None (one device: today's unsharded path)."""
    return mesh if mesh is not None else getattr(pool, "mesh", None)


def head_axis(pool: Any) -> str:
    """The mesh axis the pool's KV heads are sharded over (``pool.kv_head_axis``, default ``"tp"``)."""
    axis = getattr(pool, "kv_head_axis", None)
    if axis is not None:
        return str(axis)
    return KV_HEAD_AXIS


def check_heads_divide(what: str, heads: int, mesh: Mesh, axis: str) -> None:
    """``ValueError`` naming ``what`` when ``heads`` do not split evenly over the mesh axis."""
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)}; attention shards heads over {axis!r}")
    ranks = int(mesh.shape[axis])
    if heads % ranks:
        raise ValueError(f"{what}: {heads} heads do not split over the mesh's {axis!r} axis of {ranks} devices")


def sharded_over_heads(
    kernel: Callable[..., jax.Array],
    mesh: Mesh | None,
    specs: tuple[P, ...],
    out_spec: P,
) -> Callable[..., jax.Array]:
    """``kernel`` as is without a mesh; else wrapped in ``jax.shard_map`` with argument ``specs``
    and result ``out_spec`` (``check_vma=False``: a ``pallas_call`` carries no varying-axes
    annotations)."""
    if mesh is None:
        return kernel
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)
