"""The tensor-parallel mesh of ``--tp N``: the first ``N`` local devices on one ``"tp"`` axis.

``tp_mesh(1)`` is None (one device: the unsharded path). A larger ``N`` must not exceed the local
devices; on a CPU host, more devices come from
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax starts.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from kvjax.errors import ConfigError

__all__ = ["tp_mesh"]


def tp_mesh(tp_size: int) -> Mesh | None:
    """A ``("tp",)`` mesh of the first ``tp_size`` local devices (``Auto`` axes), or None for 1.

    Raises ``ConfigError`` on ``tp_size`` when it is below 1 or more than the local devices (the
    message says how many there are and how to get more on a CPU host); nothing is built.
    """
    if tp_size < 1:
        raise ConfigError("tp_size", tp_size, "the tensor-parallel size must be 1 or more")
    if tp_size == 1:
        return None
    devices = jax.local_devices()
    if tp_size > len(devices):
        platform = devices[0].platform
        more = (
            f"; on a CPU host set XLA_FLAGS=--xla_force_host_platform_device_count={tp_size} before starting"
            if platform == "cpu"
            else ""
        )
        raise ConfigError(
            "tp_size",
            tp_size,
            f"this host has {len(devices)} {platform} device(s); use {{tp_size}} {len(devices)} or fewer{more}",
        )
    return jax.make_mesh((tp_size,), ("tp",), axis_types=(AxisType.Auto,), devices=devices[:tp_size])
