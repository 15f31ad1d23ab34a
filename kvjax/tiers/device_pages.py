"""Which device pool kinds the host tier can copy, and how to reach their pages.

The host tier moves whole pages of every layer with the page gather/scatter kernels
(``pallas_kernels/page_gather.py``), whose contract is a tuple of per-layer arrays
``[pages + 1, page_size, C, D]`` (page 0 the trash page; ``[pages + 1, page_size, row]`` layers get
a unit head axis inside the transfers). A pool kind joins the host tier with one entry here: how
to read its layer tuple and how to put a new one back. MHA and MLA (the latent pool; not the DSA
indexer, so DSA models are refused) are registered; the SWA pools add theirs with the SWA
component's host data (``HostKVPool`` takes any page row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from kvjax.pools.mha import MHAKVPool
from kvjax.pools.mla import MLAKVPool

Layers = tuple[jax.Array, ...]

# MLA's latent layers are ``[pages + 1, page_size, row]``: the transfers add the head axis inside
# their jitted functions (a free reshape), so the host pool's page row is ``(page_size, row)``.
_ACCESS: dict[type, tuple[Callable[[Any], Layers], Callable[[Any, Layers], Any]]] = {
    MHAKVPool: (lambda pool: pool.kv, lambda pool, layers: pool.replace(kv=layers)),
    MLAKVPool: (lambda pool: pool.kv, lambda pool, layers: pool.replace(kv=layers)),
}


def register_paged_pool(
    pool_type: type, layers: Callable[[Any], Layers], with_layers: Callable[[Any, Layers], Any]
) -> None:
    """Let the host tier copy pools of ``pool_type`` (``layers(pool)``, ``with_layers(pool, new)``)."""
    _ACCESS[pool_type] = (layers, with_layers)


def _entry(pool: Any) -> tuple[Callable[[Any], Layers], Callable[[Any, Layers], Any]]:
    entry = _ACCESS.get(type(pool))
    if entry is None:
        known = ", ".join(t.__name__ for t in _ACCESS)
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
