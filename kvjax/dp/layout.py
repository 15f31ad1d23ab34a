"""`DPLayout`: where the stacked pools of a lockstep DP cache live (the mesh and each pool
array's spec), the one thing every DP program and per-rank engine needs to know of the cache.

Its own module so the DP step, the per-rank state copies and transfer engines read the layout
without importing the cache's build (``kvjax.dp.cache``, which composes them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from kvjax.dp.rank_mesh import DATA_MESH_AXIS
from kvjax.mesh_check import KV_HEAD_AXIS as KV_HEAD_MESH_AXIS

__all__ = ["DPLayout"]


@dataclasses.dataclass(frozen=True, eq=False)
class DPLayout:
    """Where the DP pools live: the ``("data", "tp")`` mesh and each pool array's spec.

    Attributes:
        mesh: the mesh, ``dp_size`` devices along ``"data"`` and ``attn_tp_size`` along ``"tp"``,
            with ``Auto`` axes (``kvjax.attention.sharding.serving_mesh``: the DP step partitions
            each rank's model over ``"tp"`` with GSPMD).
        pool_specs: a pytree of ``PartitionSpec`` with the structure of ``DPKVCache.pools``.
        rank_pools: the pytree structure of **one rank's** pools (the same leaves, without the
            rank axis; static fields of a pool built over the rank's ``("tp",)`` mesh: the rank's
            KV heads over all its devices). The DP step views each rank's slice through it.
    """

    mesh: Mesh
    pool_specs: Any
    rank_pools: Any

    @property
    def dp_size(self) -> int:
        return int(self.mesh.shape[DATA_MESH_AXIS])

    @property
    def attn_tp_size(self) -> int:
        return int(self.mesh.shape[KV_HEAD_MESH_AXIS])
