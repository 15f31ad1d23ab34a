"""`BuildContext`: what building a pool needs beyond its `PoolPlan` (jax-free: the mesh is held,
not used, here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BuildContext"]


@dataclass(frozen=True)
class BuildContext:
    """What a pool's ``create`` needs beyond its ``PoolPlan``.

    ``mesh``: a ``jax.sharding.Mesh`` or None; ``kv_head_axis``: its axis for KV heads;
    ``tp_size``: ranks along that axis (the planned per-rank heads are multiplied by it when a
    mesh shards the global array); ``platform``: where the arrays live; ``host_layout``: the host
    tier's memory layout (``hicache_mem_layout``); ``context_axis``: the mesh axis a paged pool's
    token rows are striped over under decode context parallelism (``"dcp"``), or None;
    ``dcp_size``: ranks along it (the planned per-device page rows are multiplied by it);
    ``kv_head_replicas``: ranks holding each KV head (the plan's ``Target.kv_head_replicas``): a host
    pool over a mesh holds each distinct head once and its transfer engine maps the ranks to it.
    """

    platform: str
    mesh: Any = None
    kv_head_axis: str = "tp"
    tp_size: int = 1
    host_layout: str = "layer_first"
    context_axis: str | None = None
    dcp_size: int = 1
    kv_head_replicas: int = 1
