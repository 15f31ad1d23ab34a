"""What every pool kind's builder reads of its ``PoolPlan`` (jax-free): the kind's layout record
and the global layers the pool serves."""

from __future__ import annotations

from typing import TypeVar

from kvjax.layout.pool_plan import PoolPlan

__all__ = ["planned_layers", "planned_layout"]

Layout = TypeVar("Layout")


def planned_layout(pool: PoolPlan, kind: str, layout_type: type[Layout]) -> Layout:
    """``pool.layout``, which the builder of pool kind ``kind`` reads as a ``layout_type``; a
    ``TypeError`` naming the pool and both types otherwise (a plan put together by hand)."""
    layout = pool.layout
    if not isinstance(layout, layout_type):
        raise TypeError(
            f"pool {pool.name!r} of kind {kind!r} needs a layout of type {layout_type.__name__}, "
            f"got {type(layout).__name__}"
        )
    return layout


def planned_layers(pool: PoolPlan) -> tuple[int, tuple[int, ...] | None]:
    """``(start_layer, layer_ids)`` of the global layers ``pool`` serves: ``layer_ids`` is None when
    they are consecutive from ``start_layer`` (0 for a pool of no layers), else all of them in
    array order (the interleaved layers of a hybrid model)."""
    ids = tuple(pool.layer_ids)
    start = ids[0] if ids else 0
    return start, None if ids == tuple(range(start, start + len(ids))) else ids
