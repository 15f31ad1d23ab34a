"""Cache kinds: the names that join each kind's registrations across the layers.

A cache kind (full attention, MLA, sliding window, recurrent state, the host tier, the request
table, the retraction backup) registers one record per layer, in that layer's own package:
planner hooks in ``kvjax.plan.kinds``, tree builders, allocator and request table in
``kvjax.radix.kinds``, pool builders in ``kvjax.pools.registry``, attention in
``kvjax.attention.kinds``, serving hooks in ``kvjax.serve.kinds``. This package keeps only the
names (``names``) and the registry each layer's records live in (``registry``): it imports no
other kvjax layer, and nothing here imports jax.
"""

from __future__ import annotations

from kvjax.kinds.names import BUILTIN_KINDS
from kvjax.kinds.registry import LAYERS, KindRegistry, incomplete_kinds, kind_names, registries, unregister_kind

__all__ = [
    "BUILTIN_KINDS",
    "LAYERS",
    "KindRegistry",
    "incomplete_kinds",
    "kind_names",
    "registries",
    "unregister_kind",
]
