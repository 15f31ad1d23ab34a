"""The plan layer's registration of each cache kind: `PlannerKind` (whether a model needs the
kind, the pools it plans and their sizes, its trees' names, its refusals) and `PoolKind`, one per
pool kind it plans; the built-in kinds are one module each (``full``, ``mla``, ``swa``,
``recurrent``, ``host_tier``, ``request_table``, ``retraction``), registered on import.

The planner (``kvjax.plan``) decides through these hooks and names no kind itself. Jax-free.
"""

from __future__ import annotations

from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind
from kvjax.plan.kinds.registry import (
    PLANNER_KINDS,
    is_built,
    planner_kind,
    planner_kinds,
    planner_kinds_of,
    pool_kind,
    pool_kinds,
    register_planner_kind,
)

__all__ = [
    "PLANNER_KINDS",
    "PlannerKind",
    "PoolKind",
    "is_built",
    "planner_kind",
    "planner_kinds",
    "planner_kinds_of",
    "pool_kind",
    "pool_kinds",
    "register_planner_kind",
]
