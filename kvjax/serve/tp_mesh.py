"""The tensor-parallel mesh of ``--tp N``: the first ``N`` local devices on one ``"tp"`` axis.

``tp_mesh(1)`` is None (one device: the unsharded path). A larger ``N`` is made by
``kvjax.mesh_check.make_serving_mesh`` (which refuses more ranks than local devices, saying how to
get more on a CPU host), with ``Auto`` axes (``kvjax.attention.sharding.serving_mesh``).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from kvjax.attention.sharding import serving_mesh
from kvjax.errors import ConfigError
from kvjax.mesh_check import make_serving_mesh

__all__ = ["tp_mesh"]


def tp_mesh(tp_size: int, dcp_size: int = 1) -> Mesh | None:
    """A ``("tp",)`` mesh of the first ``tp_size`` local devices (``Auto`` axes), or None for 1;
    with ``dcp_size`` above 1, the same ``tp_size`` devices laid out ``("tp", "dcp")``,
    ``(tp_size / dcp_size, dcp_size)`` (decode context parallelism divides the TP group,
    ``kvjax.mesh_check``).

    Raises ``ConfigError`` on ``tp_size`` when it is below 1 or more than the local devices (the
    message says how many there are and how to get more on a CPU host), and on ``dcp_size`` when
    it does not divide ``tp_size``; nothing is built.
    """
    if tp_size < 1:
        raise ConfigError("tp_size", tp_size, "the tensor-parallel size must be 1 or more")
    if tp_size == 1 and dcp_size == 1:
        return None
    return serving_mesh(make_serving_mesh(tp_size, devices=jax.local_devices(), dcp_size=dcp_size))
