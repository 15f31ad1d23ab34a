"""`group_tp_mesh`: the ``"tp"`` mesh of a multi-process run, over every process's devices.

Each process drives its own devices and every process takes part in every step, so the mesh
takes the same number of devices from each process, process by process (process 0's first).
"""

from __future__ import annotations

from jax.sharding import Mesh

from kvjax.attention.sharding import serving_mesh
from kvjax.errors import ConfigError
from kvjax.mesh_check import make_serving_mesh

__all__ = ["group_tp_mesh"]


def group_tp_mesh(tp_size: int) -> Mesh:
    """A ``("tp",)`` mesh of ``tp_size`` devices, ``tp_size / processes`` from each process.

    Raises ``ConfigError`` on ``tp_size`` when the processes cannot share it evenly or have
    too few devices (nothing is built).
    """
    import jax

    processes = jax.process_count()
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, []).append(device)
    local = min(len(v) for v in by_process.values())
    if tp_size % processes or tp_size // processes > local:
        raise ConfigError(
            "tp_size",
            tp_size,
            f"the mesh spans {processes} processes of {local} device(s) each and every process takes the same "
            f"share; use a multiple of {processes} up to {processes * local}",
        )
    share = tp_size // processes
    devices = [d for q in sorted(by_process) for d in by_process[q][:share]]
    return serving_mesh(make_serving_mesh(tp_size, devices=devices))
