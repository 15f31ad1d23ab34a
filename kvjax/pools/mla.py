"""`MLAKVPool`: the paged latent KV pool of MLA layers (DeepSeek-V2/V3, Kimi-K2), as an immutable pytree.

MLA caches one latent row per token and layer instead of K and V per head (SGLang's
``MLATokenToKVPool``)::

    kv[layer] : [num_pages + 1, page_size, row_padded]   (storage dtype)
    row = kv_lora_rank (compressed KV, "k_nope") + qk_rope_head_dim (rotated key, "k_rope"), zero-padded

(the layout is written once, in ``kvjax.layout.mla``). K is the whole row and V is its first
``kv_lora_rank`` elements: attention in the absorbed form reads the row once for both
(``pallas_kernels.mla_ragged_paged_attention``).

* Page 0 is the trash page; token slot ``loc`` lives at ``(loc // page_size, loc % page_size)``.
* fp8 pools keep one f32 scale per layer (the latent is K and V at once): stored = value / scale,
  read back as ``stored * scale``. Scales that are zero, negative or not finite are rejected.
* With a mesh the latent is replicated on every rank of the tensor-parallel group (one shared
  KV head, SGLang's MLA under attention TP); writes run on every rank. The pool keeps that
  ``mesh`` (static), so attention runs its Pallas kernel per device inside ``jax.shard_map``
  with the query heads split (a Mosaic kernel cannot be partitioned by XLA on TPU).

Every update returns a new pool. Under ``jax.jit`` with the pool donated the layer is updated in
place, O(tokens written) (checked by the tests and by the TPU compile tests for bf16 and fp8 on
v5e and v6e). Writes are one XLA scatter of ``n`` rows at ``(page, offset)``, except fp8 layers
lowered for TPU: there the layer is tiled ``(32, 128)`` while XLA's TPU scatter works on ``(8,
128)`` tiles and would relayout (copy) the whole layer, so those rows go in one
``dynamic_update_slice`` per token (``update_rows_in_order``), which XLA writes in place at any row.
The MHA pool's ``kv_write`` Pallas kernel is not used: its one-DMA-per-run copies start at any
slot, and Mosaic only slices a tiled HBM axis at tile-aligned offsets (multiples of 32 rows for an
fp8 layer), while viewing the latent as ``[pages + 1, page_size, 1, row]`` pads every token
to a whole tile, so the view itself is a relayout of the layer (see ``mla_layout``).

Slot ids given as concrete arrays are checked on the host (``InvalidSlotError``); inside a trace,
slots outside the pool (and the trash page) are dropped on the device, never clamped onto a live slot.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.layout.build_context import BuildContext
from kvjax.layout.mla import MLALayout
from kvjax.layout.pool_plan import PoolPlan
from kvjax.pools import dtypes
from kvjax.pools.base import PagedLayers, Pool, check_slots, route_to_trash, static_field, zeroed_layers
from kvjax.pools.input_checks import check_float_input
from kvjax.pools.planned import planned_layers, planned_layout
from kvjax.pools.striped import StripedOverContext
from pallas_kernels.validate import check_kv_scale


def _live_slots(loc: jax.Array, pages: int, page_size: int) -> jax.Array:
    """Whether each slot may be written: off the trash page and inside a ``pages``-page layer."""
    return (loc >= page_size) & (loc < pages * page_size)


def _scatter(layer: jax.Array, rows: jax.Array, loc: jax.Array) -> jax.Array:
    """One XLA scatter of ``n`` rows at ``(page, offset)``; dropped slots go out of bounds."""
    pages, page_size = layer.shape[:2]
    page = jnp.where(_live_slots(loc, pages, page_size), loc // page_size, pages)  # out of bounds: dropped
    return layer.at[page, loc % page_size].set(rows, mode="drop")


def update_rows_in_order(layer: jax.Array, rows: jax.Array, loc: jax.Array) -> jax.Array:
    """The same write as one ``dynamic_update_slice`` of a single row per token, token after token.

    The TPU path of packed (1-byte) layers: XLA's TPU scatter works on ``(8, 128)`` tiles, an fp8
    layer is tiled ``(32, 128)``, so a scatter would first relayout (copy) the whole layer, while a
    one-row update slice is written in place at any sublane offset. ``n`` sequential row updates:
    O(tokens written). A dropped slot (trash page, out of range) skips its update (``lax.cond``): a
    dynamic update slice would clamp an out-of-range index onto a live row. (Reading any row of the
    layer in the same computation, e.g. to rewrite it unchanged, makes XLA copy the layer.)
    """
    pages, page_size = layer.shape[:2]
    live = _live_slots(loc, pages, page_size)
    zero = jnp.zeros((), jnp.int32)

    def write_one(i: jax.Array, layer: jax.Array) -> jax.Array:
        row = jax.lax.dynamic_slice_in_dim(rows, i, 1)[None]
        start = (loc[i] // page_size, loc[i] % page_size, zero)
        return jax.lax.cond(live[i], lambda x: jax.lax.dynamic_update_slice(x, row, start), lambda x: x, layer)

    return jax.lax.fori_loop(0, rows.shape[0], write_one, layer, unroll=min(8, max(1, rows.shape[0])))


def scatter_rows(layer: jax.Array, rows: jax.Array, loc: jax.Array) -> jax.Array:
    """Write ``rows[i]`` (``[n, row_padded]``) into token slot ``loc[i]`` of a ``[pages, page_size,
    row_padded]`` layer; slots on the trash page or outside the layer are dropped (never clamped).

    In place under donation, O(tokens written), on every backend: one XLA scatter, except for
    1-byte (fp8) layers lowered for TPU, which take ``update_rows_in_order`` (chosen when lowering,
    ``lax.platform_dependent``; see that function for why).
    """
    loc = loc.astype(jnp.int32)
    rows = rows.astype(layer.dtype)
    if layer.dtype.itemsize != 1:
        return _scatter(layer, rows, loc)
    return jax.lax.platform_dependent(layer, rows, loc, tpu=update_rows_in_order, default=_scatter)


def _as_rows(name: str, x: jax.Array, width: int) -> jax.Array:
    """``[n, width]`` or SGLang's ``[n, 1, width]`` -> ``[n, width]``; a clear error otherwise."""
    x = jnp.asarray(x)
    check_float_input(name, x)
    if x.ndim == 3 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 2 or x.shape[1] != width:
        raise ValueError(
            f"{name} has shape {list(x.shape)}; expected [tokens, {width}] or [tokens, 1, {width}] "
            f"(this pool's {name} width is {width})"
        )
    return x


class MLAKVPool(PagedLayers, StripedOverContext, Pool):
    """Paged latent KV of the MLA layers of one pipeline stage (see module docstring).

    Data fields (pytree leaves): ``kv`` (tuple of per-layer arrays) and ``scale`` (f32
    ``[num_layers]``; 1.0 unless fp8). Meta fields are static under ``jit``.
    """

    HOST_COPYABLE: ClassVar[bool] = True

    DCP_ATTENTION = "kvjax.attention.dcp_mla_attention"

    kv: tuple[jax.Array, ...]
    scale: jax.Array
    page_size: int = static_field()
    kv_lora_rank: int = static_field()
    qk_rope_head_dim: int = static_field()
    dtype: str = static_field()
    start_layer: int = static_field(default=0)
    mesh: Mesh | None = static_field(default=None)  # set when the layers were created over a mesh
    # Decode context parallelism: the mesh axis each page's token rows are striped over
    # (``kvjax.alloc.dcp``); None otherwise (the latent is then replicated over the mesh).
    context_axis: str | None = static_field(default=None)

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: str = "bfloat16",
        platform: str = "cpu",
        row_padded: int | None = None,
        start_layer: int = 0,
        mesh: Mesh | None = None,
        context_axis: str | None = None,
    ) -> MLAKVPool:
        """Allocate a zeroed pool of ``num_pages`` allocatable pages (plus the trash page).

        ``row_padded`` defaults to the platform's (``MLALayout``: the row rounded up to 128 on TPU);
        with a ``mesh`` every layer is replicated over it, or with ``context_axis`` each page's
        token rows are sharded over that axis (decode context parallelism: ``page_size / dcp``
        rows of each rank, ``kvjax.alloc.dcp``; only ``kvjax.attention.dcp_mla_attention``
        writes and reads such a pool).
        """
        layout = MLALayout.for_platform(
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            page_size=page_size,
            dtype=dtype,
            platform=platform,
        )
        row = kv_lora_rank + qk_rope_head_dim
        padded = layout.row_padded if row_padded is None else int(row_padded)
        if padded < row:
            raise ValueError(f"row_padded={padded} is below kv_lora_rank + qk_rope_head_dim = {row}")
        store = jnp.dtype(layout.storage_dtype)
        return cls(
            kv=zeroed_layers(num_layers, (num_pages + 1, page_size, padded), store, mesh, P(None, context_axis, None)),
            scale=jnp.ones((num_layers,), jnp.float32),
            page_size=page_size,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            dtype=dtype,
            start_layer=start_layer,
            mesh=mesh,
            context_axis=context_axis if mesh is not None else None,
        )

    # --- static facts ---------------------------------------------------------------------------

    @property
    def kv_cache_dim(self) -> int:
        """``kv_lora_rank + qk_rope_head_dim`` (SGLang's name): the unpadded row."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def row_padded(self) -> int:
        return self.kv[0].shape[-1]

    @property
    def logical_dtype(self) -> np.dtype:
        return dtypes.logical_dtype(self.dtype)

    # --- writes ---------------------------------------------------------------------------------

    def _quantise(self, row: jax.Array, scale: jax.Array) -> jax.Array:
        """f32-or-any rows -> padded rows in the storage dtype (divided by ``scale`` for fp8)."""
        if dtypes.is_fp8(self.dtype):
            row = row.astype(jnp.float32) / scale
        row = jnp.pad(row.astype(self.logical_dtype), ((0, 0), (0, self.row_padded - row.shape[1])))
        return dtypes.to_storage(row, self.store_dtype)

    def _write(self, layer_id: int, loc: jax.Array, row: jax.Array, scale: float | jax.Array | None) -> MLAKVPool:
        self._require_unstriped("set_kv_buffer")
        index = self.layer_index(layer_id)
        check_slots(loc, self.num_slots)
        check_kv_scale("scale", scale)
        loc = jnp.asarray(loc)
        if loc.shape != (row.shape[0],):
            raise ValueError(f"loc has shape {list(loc.shape)}; expected [{row.shape[0]}], one slot per token")
        s = self.scale[index] if scale is None else jnp.asarray(scale, jnp.float32)
        return self.with_layer(index, scatter_rows(self.kv[index], self._quantise(row, s), loc))

    def set_mla_kv_buffer(
        self,
        layer_id: int,
        loc: jax.Array,
        cache_k_nope: jax.Array,
        cache_k_rope: jax.Array,
        scale: float | jax.Array | None = None,
    ) -> MLAKVPool:
        """Write the compressed KV ``cache_k_nope: [n, kv_lora_rank]`` and the rotated key
        ``cache_k_rope: [n, qk_rope_head_dim]`` (each also as SGLang's ``[n, 1, width]``) of ``n``
        tokens into slots ``loc`` of layer ``layer_id``; return the new pool.

        Any float dtype (cast to the pool's); fp8 pools divide by ``scale`` (default: the layer's).
        Widths that do not match the pool raise ``ValueError`` naming both; the pool is unchanged.
        """
        nope = _as_rows("cache_k_nope", cache_k_nope, self.kv_lora_rank)
        rope = _as_rows("cache_k_rope", cache_k_rope, self.qk_rope_head_dim)
        if nope.shape[0] != rope.shape[0]:
            raise ValueError(f"cache_k_nope has {nope.shape[0]} tokens but cache_k_rope has {rope.shape[0]}")
        row = jnp.concatenate([nope.astype(jnp.float32), rope.astype(jnp.float32)], axis=1)
        return self._write(layer_id, loc, row, scale)

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: jax.Array,
        cache_k: jax.Array,
        cache_v: jax.Array | None = None,
        scale: float | jax.Array | None = None,
    ) -> MLAKVPool:
        """SGLang's ``set_kv_buffer`` for MLA: ``cache_k`` is the whole row ``[n, kv_cache_dim]``
        (or ``[n, 1, kv_cache_dim]``); ``cache_v`` is ignored (V is a view of the row)."""
        del cache_v
        return self._write(layer_id, loc, _as_rows("cache_k", cache_k, self.kv_cache_dim), scale)

    def set_kv_scale(self, layer_id: int, scale: float | jax.Array) -> MLAKVPool:
        """Set one layer's fp8 scale (stored = value / scale). Existing entries are not rescaled.

        Concrete scales that are zero, negative or not finite raise ``ValueError`` (pool unchanged).
        """
        index = self.layer_index(layer_id)
        check_kv_scale("scale", scale)
        return self.replace(scale=self.scale.at[index].set(jnp.float32(scale)))

    def move_kv_cache(self, tgt_loc: jax.Array, src_loc: jax.Array) -> MLAKVPool:
        """Copy token slots ``src_loc[i] -> tgt_loc[i]`` in every layer (all reads before all writes)."""
        self._require_unstriped("move_kv_cache")
        tgt, src = self.move_slots(tgt_loc, src_loc)
        layers = []
        for layer in self.kv:
            rows = layer.reshape(self.num_slots, self.row_padded)[src]
            layers.append(scatter_rows(layer, rows, tgt))
        return self.replace(kv=tuple(layers))

    # --- reads ----------------------------------------------------------------------------------

    def kv_buffer(self, layer_id: int) -> jax.Array:
        """The layer array in the logical dtype, ``[pages + 1, page_size, row_padded]`` (a bit-cast,
        not a copy): what MLA attention reads, with the layer's ``scale``."""
        return dtypes.from_storage(self.kv[self.layer_index(layer_id)], self.logical_dtype)

    def get_key_buffer(self, layer_id: int) -> jax.Array:
        """K of one layer per token slot: ``[num_slots, 1, kv_cache_dim]`` (stored values, SGLang's shape)."""
        layer = self.kv_buffer(layer_id)
        return layer.reshape(self.num_slots, 1, self.row_padded)[..., : self.kv_cache_dim]

    def get_value_buffer(self, layer_id: int) -> jax.Array:
        """V of one layer per token slot: ``[num_slots, 1, kv_lora_rank]``, the row's first part."""
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[jax.Array, jax.Array]:
        """``(get_key_buffer(layer_id), get_value_buffer(layer_id))``."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_mla_kv_buffer(
        self, layer_id: int, loc: jax.Array, dst_dtype: Any = jnp.float32
    ) -> tuple[jax.Array, jax.Array]:
        """Dequantised ``(k_nope [n, 1, kv_lora_rank], k_rope [n, 1, qk_rope_head_dim])`` of slots
        ``loc`` in ``dst_dtype`` (O(n) reads; fp8 values multiplied back by the layer's scale)."""
        self._require_unstriped("get_mla_kv_buffer")
        index = self.layer_index(layer_id)
        check_slots(loc, self.num_slots)
        slots = route_to_trash(loc, self.num_slots)
        rows = self.kv_buffer(layer_id).reshape(self.num_slots, self.row_padded)[slots]
        rows = rows[:, None, : self.kv_cache_dim].astype(jnp.float32)
        if dtypes.is_fp8(self.dtype):
            rows = rows * self.scale[index]
        rows = rows.astype(dst_dtype)
        return rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :]


def create_pool(pool: PoolPlan, context: BuildContext) -> Any:
    """The pool kind registry's builder for ``"mla"``: the latent pool (plan ``"kv"``) or the DSA
    indexer key pool (plan ``"index_k"``) that ``MLALayout.pool_plans`` lists. Layers must be
    consecutive (each pool indexes them from ``layer_ids[0]``)."""
    layout = planned_layout(pool, "mla", MLALayout)
    start, interleaved = planned_layers(pool)
    if interleaved is not None:
        raise NotImplementedError(
            f"pool {pool.name!r} serves layers {list(interleaved)}, which are not consecutive; an MLA pool over "
            "interleaved layers is not built yet"
        )
    striped = context.mesh is not None and context.context_axis is not None and pool.name != "index_k"
    shared: dict[str, Any] = dict(
        num_pages=pool.shape[0] - 1,
        page_size=layout.page_size * (context.dcp_size if striped else 1),
        num_layers=pool.count,
        platform=context.platform,
        start_layer=start,
        mesh=context.mesh,
    )
    if pool.name == "index_k":
        from kvjax.pools.dsa_indexer import DSAIndexerKeyPool

        assert layout.index_head_dim is not None
        return DSAIndexerKeyPool.create(index_head_dim=layout.index_head_dim, **shared)
    return MLAKVPool.create(
        kv_lora_rank=layout.kv_lora_rank,
        qk_rope_head_dim=layout.qk_rope_head_dim,
        dtype=layout.dtype,
        row_padded=layout.row_padded,
        context_axis=context.context_axis if striped else None,
        **shared,
    )
