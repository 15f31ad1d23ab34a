"""The serving meshes of a multi-process run, over every process's devices: `group_tp_mesh`
(``("tp",)``, tensor parallel; ``("tp", "dcp")`` under decode context parallelism) and
`group_dp_mesh` (``("data", "tp")``, DP attention; ``("data", "tp", "dcp")`` with DCP).

Each process drives its own devices and every process takes part in every step, so a mesh takes
the same number of devices from each process, process by process (process 0's first). Under DP
attention the ranks are laid out in that order along ``"data"``: with as many ranks as processes
(or a multiple), each rank's ``"tp"`` devices belong to one process, so a rank's all-reduces never
leave its process.

Under decode context parallelism (``dcp_size`` dividing the TP group, ``kvjax.mesh_check``) the
same devices are laid out with ``"dcp"`` innermost: ``dcp_size`` consecutive devices of the list
form one ``"dcp"`` row, so when ``dcp_size`` divides each process's share (``tp_size /
processes``) a request's stripe and its per-layer query gather and log-sum-exp merge stay within
one process; the weights' all-reduces over ``("tp", "dcp")`` span the processes as plain tensor
parallelism's do.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from kvjax.attention.sharding import serving_mesh
from kvjax.errors import ConfigError
from kvjax.mesh_check import make_serving_mesh

__all__ = ["group_dp_mesh", "group_tp_mesh"]


def group_tp_mesh(tp_size: int, dcp_size: int = 1) -> Mesh:
    """A ``("tp",)`` mesh of ``tp_size`` devices, ``tp_size / processes`` from each process;
    with ``dcp_size`` above 1 the ``("tp", "dcp")`` mesh ``(tp_size / dcp_size, dcp_size)`` of
    the same devices (module docstring).

    Raises ``ConfigError`` on ``tp_size`` when the processes cannot share it evenly or have
    too few devices, and on ``dcp_size`` when it does not divide ``tp_size`` (nothing is built).
    """
    return serving_mesh(make_serving_mesh(tp_size, devices=_group_devices(tp_size), dcp_size=dcp_size))


def group_dp_mesh(tp_size: int, dp_size: int, dcp_size: int = 1) -> Mesh:
    """The ``("data", "tp")`` mesh of DP attention (``dp_size`` ranks of ``tp_size / dp_size``
    devices) over ``tp_size`` devices, ``tp_size / processes`` from each process, ranks in
    process order (module docstring); with ``dcp_size`` above 1 ``("data", "tp", "dcp")``,
    each rank's devices laid out ``(tp_size / dp_size / dcp_size, dcp_size)``.

    Raises ``ConfigError`` on ``tp_size`` as `group_tp_mesh` does, on ``dp_size`` when it
    does not divide ``tp_size``, and on ``dcp_size`` when it does not divide a rank's ``tp_size /
    dp_size`` devices (nothing is built).
    """
    devices = _group_devices(tp_size)
    return serving_mesh(make_serving_mesh(tp_size, dp_size, True, devices=devices, dcp_size=dcp_size))


def _group_devices(count: int) -> list[Any]:
    """``count`` devices, ``count / processes`` from each process, process by process."""
    import jax

    processes = jax.process_count()
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, []).append(device)
    local = min(len(v) for v in by_process.values())
    if count % processes or count // processes > local:
        raise ConfigError(
            "tp_size",
            count,
            f"the mesh spans {processes} processes of {local} device(s) each and every process takes the same "
            f"share; use a multiple of {processes} up to {processes * local}",
        )
    share = count // processes
    return [d for q in sorted(by_process) for d in by_process[q][:share]]
