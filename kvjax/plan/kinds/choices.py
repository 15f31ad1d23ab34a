"""The small records a cache kind's planner hooks answer with (`PlannerKind`): the attention
layout it chooses (`AttentionChoice`), its split of the token budget (`TokenSplit`) and a tree of
its own (`OwnTree`). Plain data, no other kvjax import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AttentionChoice", "OwnTree", "TokenSplit"]


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
