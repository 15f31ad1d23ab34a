"""`CachePools`: every device pool of one KV cache, as one pytree to donate into a serving step."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvjax.pools.mha import MHAKVPool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CachePools:
    """The device state of a KV cache.

    ``kv`` is the attention KV pool (``MHAKVPool`` today; MLA, SWA and recurrent-state pools join
    as their capabilities land). Pass the whole object to a jitted step with ``donate_argnums`` and
    return the updated one: every pool is then updated in place.
    """

    kv: MHAKVPool

    def replace(self, **changes: Any) -> CachePools:
        """A copy with some pools replaced."""
        return dataclasses.replace(self, **changes)

    def nbytes(self) -> int:
        """Bytes of every device buffer."""
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self))
