"""Which device pool kinds the host tier can copy, and how to reach their pages.

The host tier moves whole pages of every layer with the page gather/scatter kernels
(``pallas_kernels/page_gather.py``), whose contract is a tuple of per-layer arrays
``[pages + 1, page_size, C, D]`` (page 0 the trash page; ``[pages + 1, page_size, row]`` layers get
a unit head axis inside the transfers). A pool kind joins the host tier with its cache kind's
``PoolBuilders.page_access``: how to read its layer tuple and how to put a new one back. MHA and
MLA (the latent pool; not the DSA indexer, so DSA models are refused) register theirs; the SWA
pair moves its two sides with its own engine (``HostKVPool`` takes any page row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

Layers = tuple[jax.Array, ...]
PageAccess = tuple[Callable[[Any], Layers], Callable[[Any, Layers], Any]]
"""How to read a pool's per-layer page arrays, and how to put new ones back."""


def _entry(pool: Any) -> PageAccess:
    """The page access of ``pool``'s type, as its cache kind registered it
    (``PoolBuilders.page_access``, ``kvjax.pools.registry``)."""
    from kvjax.pools.registry import POOL_BUILDERS

    access = {t: a for kind in POOL_BUILDERS for t, a in kind.page_access.items()}
    entry = access.get(type(pool))
    if entry is None:
        known = ", ".join(t.__name__ for t in access)
        raise NotImplementedError(
            f"the host tier cannot copy a {type(pool).__name__} yet (paged pools it copies: {known})"
        )
    return entry


def page_layers(pool: Any) -> Layers:
    """The pool's per-layer page arrays."""
    return _entry(pool)[0](pool)


def with_page_layers(pool: Any, layers: Layers) -> Any:
    """A copy of ``pool`` holding ``layers``."""
    return _entry(pool)[1](pool, layers)
