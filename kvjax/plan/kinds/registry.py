"""The plan layer's kind registry: each cache kind's `PlannerKind`, and every pool kind by name.

``register_planner_kind`` adds a kind and its pool kinds; ``planner_kinds_of(plan)`` lists the
kinds a plan uses, in the kinds' order (``kvjax.kinds.registry``: the built-in kinds first, then
kinds registered later). The built-in kinds are registered when this package is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.errors import ConfigError
from kvjax.kinds.registry import KindRegistry
from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind

if TYPE_CHECKING:
    from kvjax.plan.cache_plan import CachePlan

__all__ = [
    "PLANNER_KINDS",
    "is_built",
    "planner_kind",
    "planner_kinds",
    "planner_kinds_of",
    "pool_kind",
    "pool_kinds",
    "register_planner_kind",
]

PLANNER_KINDS: KindRegistry[PlannerKind] = KindRegistry("plan", "kvjax.plan.kinds.register_planner_kind")


def register_planner_kind(kind: PlannerKind) -> PlannerKind:
    """Add ``kind`` (after every kind registered so far) and its pool kinds; returns it.

    Raises ``ConfigError`` (nothing changed) when its name is registered in the plan layer, or one
    of its pool kinds' names is taken or repeated.
    """
    if not isinstance(kind, PlannerKind):
        raise TypeError(f"register_planner_kind: expected a PlannerKind, got {type(kind).__name__}")
    names = [p.name for p in kind.pool_kinds]
    owner = {p.name: k.name for k in PLANNER_KINDS for p in k.pool_kinds}
    taken = sorted({n for n in names if n in owner} | {n for n in names if names.count(n) > 1})
    if taken:
        owners = [owner.get(n) for n in taken]
        raise ConfigError(
            "pool kind",
            taken[0],
            f"cache kind {kind.name!r}: pool kinds {taken} are registered (by {owners}) or repeated; "
            "give the kind's pools names of their own",
        )
    return PLANNER_KINDS.register(kind.name, kind)


def planner_kind(name: str) -> PlannerKind:
    """The kind ``name`` (``ConfigError`` naming the registered kinds otherwise)."""
    return PLANNER_KINDS[name]


def planner_kinds() -> tuple[PlannerKind, ...]:
    """Every kind registered in the plan layer, in the kinds' order."""
    return PLANNER_KINDS.entries()


def planner_kinds_of(plan: CachePlan) -> tuple[PlannerKind, ...]:
    """The kinds ``plan`` uses (``PlannerKind.used_by``), in the kinds' order."""
    return tuple(kind for kind in PLANNER_KINDS if kind.used_by(plan))


def pool_kinds() -> dict[str, PoolKind]:
    """Every pool kind of the registered kinds by name (``PoolPlan.kind``), in the kinds' order."""
    return {pool.name: pool for kind in PLANNER_KINDS for pool in kind.pool_kinds}


def pool_kind(name: str) -> PoolKind:
    """The pool kind ``name`` (``ConfigError`` naming the pool kinds otherwise)."""
    try:
        return pool_kinds()[name]
    except KeyError:
        raise ConfigError("pool kind", name, f"use one of {sorted(pool_kinds())}") from None


def is_built(kind: str) -> bool:
    """True when kvjax can build pools of ``kind`` today."""
    return pool_kind(kind).built


def _register_builtin_kinds() -> None:
    from kvjax.plan.kinds import full, host_tier, mla, recurrent, request_table, retraction, swa

    for kind in (request_table, full, mla, swa, recurrent, host_tier, retraction):
        register_planner_kind(kind.KIND)


_register_builtin_kinds()
