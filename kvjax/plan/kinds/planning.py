"""What the planner asks of the cache kinds a model needs (``PlannerKind``'s hooks; jax-free;
the records the hooks answer with are ``choices``).

``kinds_for_model`` lists the kinds that apply to a model (step 1); the later steps read them back
from ``ModelKind.cache_kinds`` (``kinds_named``) and ask each hook in the order its docstring in
``PlannerKind`` gives: registry order, or descending ``kv_pool_priority`` where one kind decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvjax.plan.kinds.planner_kind import PlannerKind
from kvjax.plan.kinds.registry import planner_kind, planner_kinds

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.plan.records import ModelKind
    from kvjax.spec import ModelSpec

__all__ = [
    "by_priority",
    "kinds_for_model",
    "kinds_named",
    "layout_kind",
    "kv_pool_kind_owner",
]


def kinds_for_model(spec: ModelSpec, config: CacheConfig) -> tuple[PlannerKind, ...]:
    """The registered kinds that apply to ``spec`` under ``config`` (``PlannerKind.applies``), in
    registry order."""
    return tuple(k for k in planner_kinds() if k.applies is not None and k.applies(spec, config))


def kinds_named(names: Iterable[str]) -> tuple[PlannerKind, ...]:
    """The registered kinds called ``names`` (``ModelKind.cache_kinds``), in that order."""
    return tuple(planner_kind(name) for name in names)


def by_priority(kinds: Iterable[PlannerKind]) -> tuple[PlannerKind, ...]:
    """``kinds`` in descending ``kv_pool_priority`` (ties: registry order)."""
    return tuple(sorted(kinds, key=lambda k: -k.kv_pool_priority))


def layout_kind(kind: ModelKind) -> PlannerKind:
    """The kind that lays out the model's attention cache: of the kinds the model needs, the one of
    the highest ``kv_pool_priority`` with an ``attention_layout`` (``LookupError`` when none)."""
    for candidate in by_priority(kinds_named(kind.cache_kinds)):
        if candidate.attention_layout is not None:
            return candidate
    raise LookupError(f"no cache kind of {list(kind.cache_kinds)} lays out the attention cache; register one")


def kv_pool_kind_owner(kind: ModelKind) -> PlannerKind:
    """The kind that names the plan's ``kv_pool_kind`` (the highest priority with one)."""
    return next(k for k in by_priority(kinds_named(kind.cache_kinds)) if k.kv_pool_kind == kind.kv_pool_kind)
