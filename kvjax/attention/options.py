"""`AttentionOptions`: the keyword options of the uniform attention signature.

``attend`` runs the attention function of the cache kind whose pool holds a layer
(``AttentionKind.attention``, ``kvjax.attention.kinds``) as
``function(pool, layer_id, q, k, v, meta, **options)`` and expects ``(out, pool)`` back. Every
such function takes these options (a kind's function refuses those that do not apply to it,
naming them); ``attend`` passes all five.
"""

from __future__ import annotations

from typing import TypedDict

import jax
from jax.sharding import Mesh

__all__ = ["AttentionOptions"]


class AttentionOptions(TypedDict, total=False):
    """``sm_scale``: logit scale (None: ``1 / sqrt(head_dim)``; MLA requires it); ``soft_cap``:
    logit soft cap or None; ``sinks``: float32 ``[heads]`` attention-sink logits or None;
    ``sliding_window``: the layer's window in tokens, or None; ``mesh``: run per device over it
    (None: the pool's own)."""

    sm_scale: float | None
    soft_cap: float | None
    sinks: jax.Array | None
    sliding_window: int | None
    mesh: Mesh | None
