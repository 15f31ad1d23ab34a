"""Mesh validation: the one place that decides whether a device mesh fits a ``CacheConfig``.

kvjax serves on a mesh of at most three named axes:

* ``"data"`` (``DATA_AXIS``): the DP-attention ranks (``dp_size`` of them with
  ``enable_dp_attention``; absent or of size 1 otherwise). Each rank owns its own tree,
  allocator, request table and pools.
* ``"tp"`` (``KV_HEAD_AXIS``): the attention tensor-parallel ranks, ``attn_tp_size`` of them
  (``tp_size / dp_size`` under DP attention, ``tp_size / dcp_size`` under DCP, else ``tp_size``).
  KV heads, query heads and the recurrent state's heads are sharded over it (under DCP the query
  heads over ``("tp", "dcp")`` jointly); a latent (MLA) pool is replicated over it.
* ``"dcp"`` (``DCP_AXIS``), under decode context parallelism only (``dcp_size > 1``). As in
  SGLang, DCP divides the TP group and uses its chips: the mesh is
  ``("tp", "dcp")`` of ``tp_size`` devices, ``tp_size / dcp_size`` on ``"tp"`` (the KV heads,
  ``attn_tp_size``) and ``dcp_size`` on ``"dcp"`` (the ranks each request's KV is striped over,
  ``kvjax.alloc.dcp``), ``"dcp"`` innermost so that its per-layer collectives (the query heads'
  all-gather and the log-sum-exp merge) run between neighbouring chips. Weights and query heads
  are split over both axes jointly (``("tp", "dcp")``, tp-major: the query heads a ``"tp"`` rank's
  KV heads serve are the union of its ``"dcp"`` row's, ``kvjax.serve.param_sharding``).
  Under DP attention DCP divides each DP rank's attention TP group (SGLang: ``attn_tp_size %
  dcp_size == 0``): the mesh is ``("data", "tp", "dcp")`` = ``(dp, tp / dp / dcp, dcp)``, each
  ``"data"`` row one rank's ``("tp", "dcp")`` group.

Every check here runs before anything is allocated and raises one ``ConfigError`` naming the
option (``tp_size`` / ``dp_size`` / ``mesh``), the value and the fix; the command line renders the
options as its flags (``--tp``, ``--dp``). The checks read plain facts (``MeshFacts``: axis
names, sizes, device platforms), so this module imports no jax; only :func:`make_serving_mesh`,
which creates a mesh, imports it when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvjax.errors import ConfigError

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from kvjax.config import CacheConfig

__all__ = [
    "DATA_AXIS",
    "DCP_AXIS",
    "KNOWN_AXES",
    "KV_HEAD_AXIS",
    "MeshFacts",
    "check_dcp_sizes",
    "check_local_devices",
    "check_mesh",
    "check_parallel_sizes",
    "make_serving_mesh",
    "serving_mesh_shape",
]

KV_HEAD_AXIS = "tp"
DATA_AXIS = "data"
DCP_AXIS = "dcp"
KNOWN_AXES = (DATA_AXIS, DCP_AXIS, KV_HEAD_AXIS)
"""The mesh axis names kvjax shards over, outermost first."""

_AXIS_ROLES = (
    f"{DATA_AXIS!r} (DP-attention ranks), {DCP_AXIS!r} (decode-context-parallel ranks: each request's KV "
    f"striped) and {KV_HEAD_AXIS!r} (attention tensor-parallel ranks: KV heads)"
)


@dataclass(frozen=True)
class MeshFacts:
    """What the checks need to know of a mesh: its axis names and sizes (in order) and the
    platform of each of its devices."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    platforms: tuple[str, ...]

    @classmethod
    def of(cls, mesh: Any) -> MeshFacts:
        """The facts of a ``jax.sharding.Mesh`` (read through its attributes; no jax import)."""
        names = tuple(str(name) for name in mesh.axis_names)
        sizes = tuple(int(mesh.shape[name]) for name in names)
        platforms = tuple(str(device.platform) for device in mesh.devices.flat)
        return cls(names, sizes, platforms)

    def size(self, axis: str) -> int:
        """Devices along ``axis`` (1 for an axis the mesh does not have)."""
        return dict(zip(self.axis_names, self.axis_sizes, strict=True)).get(axis, 1)

    @property
    def num_devices(self) -> int:
        return len(self.platforms)


def _divisors(n: int) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, found[:-1])) + (" or " if len(found) > 1 else "") + str(found[-1])


def check_parallel_sizes(tp_size: int, dp_size: int, enable_dp_attention: bool) -> None:
    """Refuse a DP size that does not split the TP group (SGLang: ``attn_tp_size = tp / dp``).

    Without DP attention ``dp_size`` is not a mesh axis (separate replicas) and is not checked.
    """
    if enable_dp_attention and tp_size % dp_size:
        raise ConfigError(
            "dp_size",
            dp_size,
            f"DP attention splits the TP group into {dp_size} equal DP ranks, and {dp_size} does not divide "
            f"{{tp_size}} {tp_size}; use {{dp_size}} {_divisors(tp_size)}, or a {{tp_size}} that {dp_size} divides",
        )


def check_dcp_sizes(dcp_size: int, tp_size: int, enable_dp_attention: bool = False, dp_size: int = 1) -> None:
    """Refuse a DCP size that cannot divide the TP group: below 1, or not dividing ``tp_size``
    (SGLang's DCP carves its ranks out of the TP group: ``tp_size`` chips in all;
    :func:`check_local_devices` checks those against the devices); under DP attention, not
    dividing a DP rank's attention TP group of ``tp_size / dp_size`` chips."""
    if isinstance(dcp_size, bool) or not isinstance(dcp_size, int) or dcp_size < 1:
        raise ConfigError("dcp_size", dcp_size, "the decode-context-parallel size must be an integer of 1 or more")
    if dcp_size == 1:
        return
    if enable_dp_attention and dp_size > 1 and not tp_size % dp_size and (tp_size // dp_size) % dcp_size:
        group = tp_size // dp_size
        raise ConfigError(
            "dcp_size",
            dcp_size,
            f"under DP attention decode context parallelism divides each DP rank's attention TP group of "
            f"{{tp_size}} {tp_size} / {{dp_size}} {dp_size} = {group} chips, and {dcp_size} does not divide "
            f"{group}; use {{dcp_size}} {_divisors(group)}",
        )
    if tp_size % dcp_size:
        raise ConfigError(
            "dcp_size",
            dcp_size,
            f"decode context parallelism divides the TP group, and {dcp_size} does not divide {{tp_size}} {tp_size}; "
            f"use {{dcp_size}} {_divisors(tp_size)}, or a {{tp_size}} that {dcp_size} divides",
        )


def serving_mesh_shape(
    tp_size: int, dp_size: int = 1, enable_dp_attention: bool = False, dcp_size: int = 1
) -> dict[str, int]:
    """The mesh kvjax serves on, axis name -> size: ``{"data": dp, "tp": tp / dp}`` under DP
    attention, ``{"tp": tp / dcp, "dcp": dcp}`` under DCP (``tp`` devices), ``{"data": dp, "tp":
    tp / dp / dcp, "dcp": dcp}`` under both, else ``{"tp": tp}``. Raises ``ConfigError`` as
    :func:`check_parallel_sizes` and :func:`check_dcp_sizes`."""
    check_parallel_sizes(tp_size, dp_size, enable_dp_attention)
    check_dcp_sizes(dcp_size, tp_size, enable_dp_attention, dp_size)
    if enable_dp_attention and dp_size > 1 and dcp_size > 1:
        return {DATA_AXIS: dp_size, KV_HEAD_AXIS: tp_size // dp_size // dcp_size, DCP_AXIS: dcp_size}
    if enable_dp_attention and dp_size > 1:
        return {DATA_AXIS: dp_size, KV_HEAD_AXIS: tp_size // dp_size}
    if dcp_size > 1:
        return {KV_HEAD_AXIS: tp_size // dcp_size, DCP_AXIS: dcp_size}
    return {KV_HEAD_AXIS: tp_size}


def check_local_devices(tp_size: int, available: int, platform: str) -> None:
    """Refuse a TP size larger than the devices this process sees (``available`` of ``platform``)."""
    if tp_size > available:
        more = (
            "; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax starts) gives N devices"
            if platform == "cpu"
            else ""
        )
        raise ConfigError(
            "tp_size",
            tp_size,
            f"only {available} {platform} device(s) are visible here and each TP rank needs its own; use "
            f"{{tp_size}} {available} or fewer{more}",
        )


def check_mesh(facts: MeshFacts, config: CacheConfig) -> None:
    """Refuse a mesh that does not fit ``config`` (module docstring), before anything is built.

    In order: axis names kvjax does not know; devices of more than one platform; no ``"tp"``
    axis; a ``"data"`` axis whose size is not the DP-attention size (``dp_size`` with
    ``enable_dp_attention``, else 1); a ``"tp"`` axis whose size is not ``config.attn_tp_size``.
    """
    check_parallel_sizes(config.tp_size, config.dp_size, config.enable_dp_attention)
    check_dcp_sizes(config.dcp_size, config.tp_size, config.enable_dp_attention, config.dp_size)
    unknown = [name for name in facts.axis_names if name not in KNOWN_AXES]
    if unknown:
        shape = serving_mesh_shape(config.tp_size, config.dp_size, config.enable_dp_attention, config.dcp_size)
        sizes, names = tuple(shape.values()), tuple(shape)
        raise ConfigError(
            "mesh",
            facts.axis_names,
            f"kvjax does not know the mesh axis {unknown[0]!r}; it shards over {_AXIS_ROLES}: build the mesh "
            f"as jax.make_mesh({sizes}, {names}) (kvjax.mesh_check.make_serving_mesh makes it)",
        )
    platforms = sorted(set(facts.platforms))
    if len(platforms) > 1:
        raise ConfigError(
            "mesh",
            tuple(platforms),
            f"its devices are of {len(platforms)} platforms ({', '.join(platforms)}); a cache lives on one: build "
            f"the mesh over one platform's devices, e.g. jax.devices({platforms[-1]!r})",
        )
    if KV_HEAD_AXIS not in facts.axis_names:
        raise ConfigError(
            "mesh",
            facts.axis_names,
            f"name the KV-head axis {KV_HEAD_AXIS!r} (kvjax shards over {_AXIS_ROLES})",
        )
    dp_ranks = config.dp_size if config.enable_dp_attention else 1
    data_axis = facts.size(DATA_AXIS)
    if data_axis != dp_ranks:
        fix = (
            f"build the mesh with {dp_ranks} devices on {DATA_AXIS!r}, or set {{dp_size}} {data_axis}"
            if config.enable_dp_attention
            else f"set {{dp_size}} {data_axis} with enable_dp_attention, or drop the {DATA_AXIS!r} axis"
        )
        raise ConfigError(
            "dp_size",
            config.dp_size,
            f"the mesh's {DATA_AXIS!r} axis has {data_axis} device(s) but there are {dp_ranks} DP-attention rank(s); "
            + fix,
        )
    dcp_axis = facts.size(DCP_AXIS)
    if dcp_axis != config.dcp_size:
        shape = serving_mesh_shape(config.tp_size, config.dp_size, config.enable_dp_attention, config.dcp_size)
        raise ConfigError(
            "dcp_size",
            config.dcp_size,
            f"the mesh's {DCP_AXIS!r} axis has {dcp_axis} device(s) but KV is striped over {config.dcp_size} DCP "
            f"rank(s); build the mesh as jax.make_mesh({tuple(shape.values())}, {tuple(shape)}) "
            "(kvjax.mesh_check.make_serving_mesh makes it), or set {dcp_size} to match the mesh",
        )
    tp_axis = facts.size(KV_HEAD_AXIS)
    if tp_axis != config.attn_tp_size:
        parts = [f"tp_size {config.tp_size}"]
        parts += [f"dp_size {config.dp_size}"] if config.enable_dp_attention else []
        parts += [f"dcp_size {config.dcp_size}"] if config.dcp_enabled else []
        under_dp = f" ({' / '.join(parts)})" if len(parts) > 1 else ""
        raise ConfigError(
            "tp_size",
            config.tp_size,
            f"the mesh's {KV_HEAD_AXIS!r} axis has {tp_axis} devices but attention TP is {config.attn_tp_size}"
            f"{under_dp}; build the mesh with {config.attn_tp_size} devices on {KV_HEAD_AXIS!r}, or set "
            f"{{tp_size}} to match the mesh",
        )


def make_serving_mesh(
    tp_size: int,
    dp_size: int = 1,
    enable_dp_attention: bool = False,
    devices: Sequence[Any] | None = None,
    dcp_size: int = 1,
) -> Mesh:
    """The mesh kvjax serves ``tp_size`` ranks on (:func:`serving_mesh_shape`), over the first
    ``tp_size`` of ``devices`` (default: this process's devices of the default platform); under
    DCP the same ``tp_size`` devices, laid out ``("tp", "dcp")``.

    Raises ``ConfigError`` before creating anything: ``dp_size`` not dividing ``tp_size`` under DP
    attention, ``dcp_size`` not dividing ``tp_size``, more TP ranks than devices, devices of more
    than one platform.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    shape = serving_mesh_shape(tp_size, dp_size, enable_dp_attention, dcp_size)
    devices = list(jax.devices() if devices is None else devices)
    platforms = sorted({str(d.platform) for d in devices})
    if len(platforms) > 1:
        raise ConfigError(
            "mesh",
            tuple(platforms),
            f"the devices are of {len(platforms)} platforms ({', '.join(platforms)}); pass one platform's devices",
        )
    check_local_devices(tp_size, len(devices), platforms[0] if platforms else "no")
    grid = np.array(devices[:tp_size], dtype=object).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape))
