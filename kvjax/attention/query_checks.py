"""Checks of a layer's queries against the pool it attends over, before any write.

A query of the wrong head dim would otherwise run: the kernel reads the pool's first ``head_dim``
lanes and returns ``[T, heads, q_head_dim]`` with no error. Every check raises ``ValueError`` (or
``TypeError`` for a dtype) naming the layer, the array, what it has and what the pool needs;
nothing is written.
"""

from __future__ import annotations

from typing import Any

from kvjax.pools.input_checks import check_float_input

__all__ = ["check_query"]


def check_query(name: str, q: Any, layer_id: int, head_dim: int, *, tokens: int | None = None) -> None:
    """``q`` is a float ``[T, heads, head_dim]`` (``T == tokens`` when given)."""
    check_float_input(f"layer {layer_id}'s {name}", q)
    shape = tuple(getattr(q, "shape", ()))
    if len(shape) != 3 or shape[2] != head_dim:
        raise ValueError(
            f"layer {layer_id}'s {name} has shape {list(shape)}; expected [tokens, heads, {head_dim}]: the pool "
            f"holds head_dim {head_dim} for this layer (the model's head_dim, as the ModelSpec / CacheConfig built it)"
        )
    if tokens is not None and shape[0] != tokens:
        raise ValueError(
            f"layer {layer_id}'s {name} has {shape[0]} tokens; the batch writes {tokens} (one K/V row per query token)"
        )
