"""Where DP ranks lie on the ``("data", "tp")`` mesh (``("data", "tp", "dcp")`` under decode
context parallelism): the axis name, a rank's devices and mesh, and how the DP programs take host
inputs with a leading rank axis. Kept apart from the cache, the step and
the per-rank transfers so that each of them reads these facts without importing the others."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["DATA_MESH_AXIS", "host_sharding", "rank_devices", "rank_mesh"]

DATA_MESH_AXIS = "data"
"""The mesh axis DP ranks are laid out over (sglang-jax's name)."""


def rank_devices(mesh: Mesh, rank: int) -> np.ndarray:
    """The devices of DP rank ``rank`` of ``mesh``, in ``"tp"`` order."""
    return np.take(mesh.devices, rank, axis=tuple(mesh.axis_names).index(DATA_MESH_AXIS)).reshape(-1)


def rank_mesh(mesh: Mesh, rank: int) -> Mesh:
    """DP rank ``rank``'s own mesh: its devices over the axes of ``mesh`` other than ``"data"``
    (``("tp",)``, or ``("tp", "dcp")`` under decode context parallelism), in the same layout."""
    names = tuple(mesh.axis_names)
    grid = np.take(mesh.devices, rank, axis=names.index(DATA_MESH_AXIS))
    return Mesh(grid, tuple(name for name in names if name != DATA_MESH_AXIS))


def host_sharding(mesh: Mesh) -> NamedSharding:
    """How the DP programs take host inputs with a leading rank axis (and give their per-rank
    outputs): by rank over ``"data"`` when this process holds every device of ``mesh``;
    replicated when the mesh spans several processes, each of which runs every rank's scheduler
    (a host array of every rank's rows is what every process has, and a by-rank array over
    another process's devices could be neither passed nor read here)."""
    if all(d.process_index == jax.process_index() for d in mesh.devices.flat):
        return NamedSharding(mesh, P(DATA_MESH_AXIS))
    return NamedSharding(mesh, P())
