"""What the planner asks of the cache kinds a model needs, and the small records their planner
hooks answer with (``PlannerKind``'s hooks; jax-free).

``kinds_for_model`` lists the kinds that apply to a model (step 1); the later steps read them back
from ``ModelKind.cache_kinds`` (``kinds_named``) and ask each hook in the order its docstring in
``PlannerKind`` gives: registry order, or descending ``kv_pool_priority`` where one kind decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvjax.plan.kinds.planner_kind import PlannerKind
from kvjax.plan.kinds.registry import planner_kind, planner_kinds

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.plan.records import ModelKind
    from kvjax.spec import ModelSpec

__all__ = [
    "AttentionChoice",
    "OwnTree",
    "TokenSplit",
    "by_priority",
    "kinds_for_model",
    "kinds_named",
    "layout_kind",
    "kv_pool_kind_owner",
]


@dataclass(frozen=True)
class TokenSplit:
    """A kind's split of the token budget between its pools (``PlannerKind.split_tokens``).

    Token counts are per layer and multiples of the allocation page. ``max_total_tokens``: the
    allocator's size (the full pool's, or the windowed pool's when no layer is full);
    ``request_window``: the most tokens one request holds at once when that is less than its
    context (a sliding window with no full layer), else None.
    """

    full_tokens_per_layer: int
    swa_tokens_per_layer: int
    max_total_tokens: int
    request_window: int | None = None


@dataclass(frozen=True)
class OwnTree:
    """A tree of a kind's own (``PlannerKind.own_tree``): its ``tree_cache_kind`` and components."""

    tree_cache_kind: str
    components: tuple[str, ...]


@dataclass(frozen=True)
class AttentionChoice:
    """The per-token attention cache's layout on the target (``PlannerKind.attention_layout``).

    ``layout``: an ``MHALayout`` or ``MLALayout``; ``heads_per_rank``, ``replicas``: KV heads per
    rank and ranks holding each; ``head_dim_padded``: the padded head (or latent row) width;
    ``bytes_per_token_per_layer``: every per-token array of one layer, per rank; ``padding``: what
    the layout pads, in words.
    """

    layout: Any
    heads_per_rank: int
    replicas: int
    head_dim_padded: int
    bytes_per_token_per_layer: int
    padding: tuple[str, ...]


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
