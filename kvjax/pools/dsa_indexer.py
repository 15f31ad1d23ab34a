"""`DSAIndexerKeyPool`: the DeepSeek sparse-attention (DSA, V3.2) indexer's key cache, paged like the
latent pool it rides along with, as an immutable pytree.

One uint8 array per layer in SGLang's NSA page layout (``kvjax.layout.mla``)::

    index_k[layer] : [num_pages + 1, page_size * (D + D // 128 * 4)]   D = index_head_dim

Within page ``p``: bytes ``[o * D, (o + 1) * D)`` are the fp8 (e4m3) key of the token at offset
``o``; bytes ``page_size * D + [o * S, (o + 1) * S)`` with ``S = D // 128 * 4`` are its f32 scales,
one per block of 128 key elements (little-endian). Page 0 is the trash page. A token's key is
``fp8 * scale`` blockwise.

Quantisation (``set_index_k``): per block of 128 elements, ``scale = max(amax, 1e-4) / 448`` (448
is e4m3's largest value), key = ``x / scale`` cast to e4m3, as DeepSeek's ``act_quant`` without the
optional power-of-two rounding of the scale. Callers that quantise themselves use
``set_index_k_and_scale`` (SGLang's ``set_index_k_scale_buffer``).

Writes put ``n`` tokens' bytes at ``(page, byte offset)``, in place under ``jax.jit`` with the
pool donated, O(tokens written): two XLA scatters, except when lowered for TPU (chosen with
``lax.platform_dependent``), where a large uint8 layer (tiled ``(32, 128)``) would be copied by
XLA's ``(8, 128)``-tile scatter, so each token is two ``dynamic_update_slice`` (checked at a 256 MiB
layer by the TPU compile test). Concrete slot ids are checked on the host; traced ones outside the
pool (and the trash page) are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvjax.layout.mla import INDEXER_SCALE_BLOCK, INDEXER_SCALE_BYTES
from kvjax.pools.base import PagedLayers, Pool, check_slots, route_to_trash, static_field, zeroed_layers

#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Smallest amax a block is scaled for (an all-zero block gets a finite scale).
MIN_AMAX = 1e-4


def quantise_index_k(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``keys: [n, D]`` -> (e4m3 ``[n, D]``, f32 scales ``[n, D // 128]``), blockwise (module docstring)."""
    n, dim = keys.shape
    blocks = keys.astype(jnp.float32).reshape(n, dim // INDEXER_SCALE_BLOCK, INDEXER_SCALE_BLOCK)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), MIN_AMAX) / E4M3_MAX
    quantised = (blocks / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(n, dim)
    return quantised, scale


class DSAIndexerKeyPool(PagedLayers, Pool):
    """Paged fp8 indexer keys and their f32 scales of the DSA layers (see module docstring)."""

    LAYERS_FIELD = "index_k"

    index_k: tuple[jax.Array, ...]
    page_size: int = static_field()
    index_head_dim: int = static_field()
    start_layer: int = static_field(default=0)

    @classmethod
    def create(
        cls,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        index_head_dim: int,
        platform: str = "cpu",
        start_layer: int = 0,
        mesh: Mesh | None = None,
    ) -> DSAIndexerKeyPool:
        """A zeroed pool of ``num_pages`` pages (plus the trash page); replicated over ``mesh``.

        ``index_head_dim`` must be a positive multiple of 128 (one scale per 128 elements).
        ``platform`` is accepted for symmetry with the other pools: uint8 is stored as is everywhere.
        """
        del platform
        if index_head_dim <= 0 or index_head_dim % INDEXER_SCALE_BLOCK:
            raise ValueError(
                f"index_head_dim={index_head_dim} must be a positive multiple of {INDEXER_SCALE_BLOCK} "
                "(one f32 scale per 128 key elements)"
            )
        token_bytes = index_head_dim + index_head_dim // INDEXER_SCALE_BLOCK * INDEXER_SCALE_BYTES
        return cls(
            index_k=zeroed_layers(num_layers, (num_pages + 1, page_size * token_bytes), jnp.uint8, mesh),
            page_size=page_size,
            index_head_dim=index_head_dim,
            start_layer=start_layer,
        )

    @property
    def scales_per_token(self) -> int:
        return self.index_head_dim // INDEXER_SCALE_BLOCK

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.index_head_dim + self.scales_per_token * INDEXER_SCALE_BYTES

    def _columns(self, offset: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Byte columns within a page of the keys ``[n, D]`` and scales ``[n, S * 4]`` of tokens at ``offset``."""
        d, s = self.index_head_dim, self.scales_per_token * INDEXER_SCALE_BYTES
        key_cols = offset[:, None] * d + jnp.arange(d, dtype=jnp.int32)[None, :]
        scale_cols = self.page_size * d + offset[:, None] * s + jnp.arange(s, dtype=jnp.int32)[None, :]
        return key_cols, scale_cols

    # --- writes: two strategies, one result --------------------------------------------------------
    # ``set_index_k_and_scale`` picks one when lowering (``lax.platform_dependent``): the update
    # slices on TPU, the scatters elsewhere. Both take one layer array, the int32 slots ``loc [n]``,
    # ``live [n]`` (False: the token is dropped, its slot on the trash page or outside the layer),
    # the key bytes ``[n, D]`` and the scale bytes ``[n, D // 128 * 4]``, and return the new layer.

    def scatter_tokens(
        self, layer: jax.Array, loc: jax.Array, live: jax.Array, key_bytes: jax.Array, scale_bytes: jax.Array
    ) -> jax.Array:
        """Two XLA scatters of the tokens' key and scale bytes; dropped tokens go out of bounds."""
        page = jnp.where(live, loc // self.page_size, layer.shape[0])[:, None]  # out of bounds: dropped
        key_cols, scale_cols = self._columns(loc % self.page_size)
        layer = layer.at[page, key_cols].set(key_bytes, mode="drop")
        return layer.at[page, scale_cols].set(scale_bytes, mode="drop")

    def update_tokens_in_order(
        self, layer: jax.Array, loc: jax.Array, live: jax.Array, key_bytes: jax.Array, scale_bytes: jax.Array
    ) -> jax.Array:
        """The same write as two ``dynamic_update_slice`` per token, token after token (the TPU path).

        A uint8 layer is tiled ``(32, 128)`` on TPU and XLA's TPU scatter works on ``(8, 128)``
        tiles: above some tens of MiB per layer the scatter compiles to a copy of the layer, while a
        one-token update slice is written in place. Dropped tokens skip their update (``lax.cond``),
        never clamped onto a live slot."""
        d, s = self.index_head_dim, scale_bytes.shape[1]

        def write_one(i: jax.Array, layer: jax.Array) -> jax.Array:
            page, offset = loc[i] // self.page_size, loc[i] % self.page_size
            key = jax.lax.dynamic_slice_in_dim(key_bytes, i, 1)
            scale = jax.lax.dynamic_slice_in_dim(scale_bytes, i, 1)

            def write(x: jax.Array) -> jax.Array:
                x = jax.lax.dynamic_update_slice(x, key, (page, offset * d))
                return jax.lax.dynamic_update_slice(x, scale, (page, self.page_size * d + offset * s))

            return jax.lax.cond(live[i], write, lambda x: x, layer)

        return jax.lax.fori_loop(0, loc.shape[0], write_one, layer, unroll=min(8, max(1, loc.shape[0])))

    def set_index_k_and_scale(
        self, layer_id: int, loc: jax.Array, index_k: jax.Array, index_k_scale: jax.Array
    ) -> DSAIndexerKeyPool:
        """Write quantised keys ``index_k: [n, D]`` (e4m3, or its uint8 bits) and their scales
        ``index_k_scale: [n, D // 128]`` (f32) into slots ``loc`` of layer ``layer_id``."""
        index = self.layer_index(layer_id)
        check_slots(loc, self.num_slots)
        n = index_k.shape[0]
        if index_k.shape != (n, self.index_head_dim):
            raise ValueError(f"index_k has shape {list(index_k.shape)}; expected [tokens, {self.index_head_dim}]")
        if index_k_scale.shape != (n, self.scales_per_token):
            raise ValueError(
                f"index_k_scale has shape {list(index_k_scale.shape)}; expected [{n}, {self.scales_per_token}]"
            )
        loc = jnp.asarray(loc, jnp.int32)
        if loc.shape != (n,):
            raise ValueError(f"loc has shape {list(loc.shape)}; expected [{n}], one slot per token")
        key_bytes = index_k if index_k.dtype == jnp.uint8 else index_k.astype(jnp.float8_e4m3fn).view(jnp.uint8)
        scale_bytes = jax.lax.bitcast_convert_type(index_k_scale.astype(jnp.float32), jnp.uint8).reshape(n, -1)
        live = (loc >= self.page_size) & (loc < self.num_slots)
        layer = jax.lax.platform_dependent(
            self.index_k[index],
            loc,
            live,
            key_bytes,
            scale_bytes,
            tpu=self.update_tokens_in_order,
            default=self.scatter_tokens,
        )
        return self.with_layer(index, layer)

    def set_index_k(self, layer_id: int, loc: jax.Array, keys: jax.Array) -> DSAIndexerKeyPool:
        """Quantise ``keys: [n, index_head_dim]`` blockwise (``quantise_index_k``) and write them."""
        if keys.ndim != 2 or keys.shape[1] != self.index_head_dim:
            raise ValueError(f"keys has shape {list(keys.shape)}; expected [tokens, {self.index_head_dim}]")
        quantised, scale = quantise_index_k(keys)
        return self.set_index_k_and_scale(layer_id, loc, quantised, scale)

    def get_index_k_and_scale(self, layer_id: int, loc: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The stored e4m3 keys ``[n, D]`` and f32 scales ``[n, D // 128]`` of slots ``loc``."""
        index = self.layer_index(layer_id)
        check_slots(loc, self.num_slots)
        loc = route_to_trash(loc, self.num_slots)
        layer = self.index_k[index]
        page = (loc // self.page_size)[:, None]
        key_cols, scale_cols = self._columns(loc % self.page_size)
        keys = layer[page, key_cols].view(jnp.float8_e4m3fn)
        n = loc.shape[0]
        scale_bytes = layer[page, scale_cols].reshape(n, self.scales_per_token, INDEXER_SCALE_BYTES)
        return keys, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)

    def get_index_k(self, layer_id: int, loc: jax.Array) -> jax.Array:
        """Dequantised keys ``[n, D]`` (f32) of slots ``loc``."""
        keys, scale = self.get_index_k_and_scale(layer_id, loc)
        n = keys.shape[0]
        blocks = keys.astype(jnp.float32).reshape(n, self.scales_per_token, INDEXER_SCALE_BLOCK)
        return (blocks * scale[..., None]).reshape(n, self.index_head_dim)

    def page_bytes(self, layer_id: int) -> np.ndarray:
        """Host copy of one layer's bytes (for inspection and tests)."""
        return np.asarray(self.index_k[self.layer_index(layer_id)])
