"""Running an attention kernel per device when the pool is sharded over its KV-head axis.

Pallas kernels are not partitioned automatically: over a mesh, a kernel runs inside
``jax.shard_map`` on each device's slice. The query's head axis and the pool's combined K/V head
axis are sharded over the mesh's KV-head axis (``"tp"``, ``kvjax.build.KV_HEAD_MESH_AXIS``); the
metadata and scales are replicated. Each device holds whole KV heads (K and V of head ``h`` are
adjacent, ``kvjax.pools.mha``) and the query heads of a GQA group are contiguous
(``q head i`` reads ``kv head i // group``), so contiguous blocks of both line up. With no mesh
the kernel is called as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

__all__ = ["check_heads_divide", "head_axis", "pool_mesh", "sharded_over_heads"]


def pool_mesh(pool: Any, mesh: Mesh | None) -> Mesh | None:
    """The mesh to run on: ``mesh`` when given, else the pool's own (``pool.mesh``, set when its
    layers were created sharded), else None (one device: today's unsharded path)."""
    return mesh if mesh is not None else getattr(pool, "mesh", None)


def head_axis(pool: Any) -> str:
    """The mesh axis the pool's KV heads are sharded over (``pool.kv_head_axis``, default ``"tp"``)."""
    axis = getattr(pool, "kv_head_axis", None)
    if axis is not None:
        return str(axis)
    from kvjax.build import KV_HEAD_MESH_AXIS

    return KV_HEAD_MESH_AXIS


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
