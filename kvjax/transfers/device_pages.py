"""Which device pool kinds the host tier can copy, and how to reach their pages.

The host tier moves whole pages of every layer with the page gather/scatter kernels
(``pallas_kernels/page_gather.py``), whose contract is a tuple of per-layer arrays
``[pages + 1, page_size, C, D]`` (page 0 the trash page; ``[pages + 1, page_size, row]`` layers get
a unit head axis inside the transfers). A paged pool (``PagedLayers``: its layer tuple and how
to put a new one back) joins the host tier by saying so in its class (``HOST_COPYABLE = True``):
MHA and MLA (the latent pool; not the DSA indexer, so DSA models are refused) do; the SWA pair
moves its two sides with its own engine (``HostKVPool`` takes any page row).
"""

from __future__ import annotations

from typing import Any

import jax

Layers = tuple[jax.Array, ...]


def _copyable(pool: Any) -> None:
    """``NotImplementedError`` naming the pool's class unless the host tier can copy its pages."""
    if not getattr(type(pool), "HOST_COPYABLE", False):
        raise NotImplementedError(
            f"the host tier cannot copy a {type(pool).__name__} yet (a pool it copies is a PagedLayers "
            "whose class sets HOST_COPYABLE = True: MHAKVPool, MLAKVPool)"
        )


def page_layers(pool: Any) -> Layers:
    """The pool's per-layer page arrays (``PagedLayers.layer_arrays``)."""
    _copyable(pool)
    layers: Layers = pool.layer_arrays
    return layers


def with_page_layers(pool: Any, layers: Layers) -> Any:
    """A copy of ``pool`` holding ``layers``."""
    _copyable(pool)
    return pool.replace(**{pool.LAYERS_FIELD: tuple(layers)})
