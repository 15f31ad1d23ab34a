"""`MHAKVPool`: the paged K/V pool of full-attention (MHA/GQA/MQA) layers, as an immutable pytree.

Layout (one array per layer, tpu-inference's ragged-paged-attention layout; the shape and the
padding rule are written once, in ``kvjax.layout.mha`` and ``kvjax.layout.alignment``)::

    kv[layer] : [num_pages + 1, page_size, 2 * num_kv_heads, head_dim_padded]   (storage dtype)

* Page 0 is the trash page: padded tokens write there and allocators never hand it out, so the
  array has ``num_pages + 1`` pages and token slot ``loc`` lives at ``(loc // page_size, loc % page_size)``.
* Along the combined head axis, index ``2h`` is K of KV head ``h`` and ``2h + 1`` is V of head ``h``.
  Sharding that axis over a mesh keeps each head's K and V on one device.
* ``head_dim_padded`` is ``max(head_dim, v_head_dim)`` rounded up to the platform's alignment
  (128 on TPU, 1 elsewhere); K and V are zero-padded to it.
* The storage dtype may be the bit pattern of the logical dtype (see ``kvjax.pools.dtypes``).
* fp8 pools keep a per-layer f32 scale for K and for V: stored = value / scale.

Every update returns a new pool. Under ``jax.jit`` with the pool donated the update is in place:
its cost grows with the tokens written, never with the pool.

Slot ids given as concrete arrays are checked on the host (``InvalidSlotError`` naming them);
inside a trace they cannot be, and any slot outside ``[0, (num_pages + 1) * page_size)`` is routed
to the trash page on the device, never clamped onto a live slot.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.layout.build_context import BuildContext
from kvjax.layout.mha import MHALayout
from kvjax.layout.pool_plan import PoolPlan
from kvjax.pools import dtypes
from kvjax.pools.base import PagedLayers, Pool, check_slots, route_to_trash, static_field, zeroed_layers
from kvjax.pools.input_checks import check_float_input
from kvjax.pools.planned import planned_layers, planned_layout
from kvjax.pools.striped import StripedOverContext
from pallas_kernels.kv_write import write_kv
from pallas_kernels.page_copy import copy_slots
from pallas_kernels.validate import check_kv_scale


def _write_slots(layer: jax.Array, new_kv: jax.Array, loc: jax.Array) -> jax.Array:
    """Scatter ``new_kv[i]`` (``[n, C, D]``) into token slot ``loc[i]`` of one layer array.

    ``loc`` has already been routed into range. Rows aimed at the trash page are dropped (the
    page is left as it was); live slots are never written twice by a valid caller. Pallas
    kernel when lowered for TPU, its jnp reference elsewhere (``pallas_kernels.kv_write``).
    """
    return write_kv(layer, new_kv, loc)


def _copy_slots(layers: tuple[jax.Array, ...], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """Copy token slots ``src[i] -> dst[i]`` in every layer; all reads happen before all writes.

    Targets on the trash page are dropped. Pallas kernel when lowered for TPU, its jnp
    reference elsewhere (``pallas_kernels.page_copy``).
    """
    return copy_slots(layers, src, dst)


class MHAKVPool(PagedLayers, StripedOverContext, Pool):
    """Paged K/V of the full-attention layers of one pipeline stage (see module docstring).

    Data fields (pytree leaves): ``kv`` (tuple of per-layer arrays), ``k_scale`` and ``v_scale``
    (f32 ``[num_layers]``; 1.0 unless fp8). Meta fields are static under ``jit``.
    """

    HOST_COPYABLE: ClassVar[bool] = True

    DCP_ATTENTION = "kvjax.attention.dcp_attention"

    LAYER_KIND = "full attention"

    kv: tuple[jax.Array, ...]
    k_scale: jax.Array
    v_scale: jax.Array
    page_size: int = static_field()
    num_kv_heads: int = static_field()
    head_dim: int = static_field()
    v_head_dim: int = static_field()
    dtype: str = static_field()
    start_layer: int = static_field(default=0)
    mesh: Mesh | None = static_field(default=None)  # set when the layers are sharded over KV heads
    kv_head_axis: str | None = static_field(default=None)
    # Decode context parallelism: the mesh axis each page's token rows are striped over (rank ``r``
    # holds rows ``r * page_size / dcp ...``; ``kvjax.alloc.dcp_stripe``), or None.
    context_axis: str | None = static_field(default=None)
    # Global ids of the layers, when they are not consecutive from ``start_layer`` (the
    # full-attention layers of a hybrid model: SGLang's ``HybridLinearKVPool`` mapping).
    layer_ids: tuple[int, ...] | None = static_field(default=None)

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        dtype: str = "bfloat16",
        platform: str = "cpu",
        head_dim_alignment: int | None = None,
        start_layer: int = 0,
        mesh: Mesh | None = None,
        kv_head_axis: str = "tp",
        layer_ids: tuple[int, ...] | None = None,
        context_axis: str | None = None,
    ) -> MHAKVPool:
        """Allocate a zeroed pool of ``num_pages`` allocatable pages (plus the trash page).

        ``head_dim_alignment`` defaults to the platform's (``kvjax.layout.alignment``: 128 on TPU,
        1 elsewhere). Each layer is created
        directly on its device(s) (no host staging), one at a time. With a ``mesh``, the combined
        K/V head axis is sharded over its ``kv_head_axis`` (each device holds whole heads, K and V
        together) and updates run per device under ``shard_map``: the Pallas kernels are not
        partitioned automatically. ``layer_ids``: the global layer ids of interleaved layers
        (``num_layers`` of them; ``start_layer`` is then ignored). ``context_axis`` (with a mesh):
        each page's token rows are also sharded over that axis (decode context parallelism; the
        page holds ``page_size / dcp`` rows of each rank, ``kvjax.alloc.dcp_stripe``); only
        ``kvjax.attention.dcp_attention`` writes and reads such a pool.
        """
        if layer_ids is not None and len(layer_ids) != num_layers:
            raise ValueError(f"layer_ids lists {len(layer_ids)} layers; num_layers is {num_layers}")
        layout = MHALayout.for_platform(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            page_size=page_size,
            dtype=dtype,
            platform=platform,
            head_dim_alignment_override=head_dim_alignment,
        )
        v_head_dim = layout.v_head_dim
        store = jnp.dtype(layout.storage_dtype)
        return cls(
            kv=zeroed_layers(num_layers, layout.shape(num_pages), store, mesh, _HEAD_SPEC(kv_head_axis, context_axis)),
            k_scale=jnp.ones((num_layers,), jnp.float32),
            v_scale=jnp.ones((num_layers,), jnp.float32),
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            dtype=dtype,
            start_layer=start_layer,
            mesh=mesh,
            kv_head_axis=kv_head_axis if mesh is not None else None,
            layer_ids=None if layer_ids is None else tuple(int(i) for i in layer_ids),
            context_axis=context_axis if mesh is not None else None,
        )

    # --- static facts ---------------------------------------------------------------------------

    @property
    def head_dim_padded(self) -> int:
        return self.kv[0].shape[-1]

    @property
    def logical_dtype(self) -> np.dtype:
        return dtypes.logical_dtype(self.dtype)

    # --- writes ---------------------------------------------------------------------------------

    def _pack(self, k: jax.Array, v: jax.Array, k_scale: jax.Array, v_scale: jax.Array, n: int) -> jax.Array:
        """``[n, H, Dk]`` and ``[n, H, Dv]`` (``n``: the slots written) -> interleaved, padded,
        quantised ``[n, 2H, Dp]`` storage."""
        check_float_input("k", k, self.dtype)
        check_float_input("v", v, self.dtype)
        if k.ndim and v.ndim and k.shape[0] == v.shape[0] != n:
            raise ValueError(f"loc has shape ({n},); k and v have {k.shape[0]} tokens: give one slot per token")
        want_k = (n, self.num_kv_heads, self.head_dim)
        want_v = (n, self.num_kv_heads, self.v_head_dim)
        if k.shape != want_k:
            raise ValueError(f"k has shape {k.shape}; expected {want_k} ([tokens, kv_heads, head_dim])")
        if v.shape != want_v:
            raise ValueError(f"v has shape {v.shape}; expected {want_v} ([tokens, kv_heads, v_head_dim])")
        logical = self.logical_dtype
        if dtypes.is_fp8(self.dtype):
            k = k.astype(jnp.float32) / k_scale
            v = v.astype(jnp.float32) / v_scale
        pad = self.head_dim_padded
        k = jnp.pad(k.astype(logical), ((0, 0), (0, 0), (0, pad - self.head_dim)))
        v = jnp.pad(v.astype(logical), ((0, 0), (0, 0), (0, pad - self.v_head_dim)))
        kv = jnp.stack([k, v], axis=2).reshape(n, 2 * self.num_kv_heads, pad)
        return dtypes.to_storage(kv, self.store_dtype)

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: jax.Array,
        k: jax.Array,
        v: jax.Array,
        k_scale: float | jax.Array | None = None,
        v_scale: float | jax.Array | None = None,
    ) -> MHAKVPool:
        """Write ``k[i]``, ``v[i]`` into token slot ``loc[i]`` of layer ``layer_id``; return the new pool.

        ``k``: ``[n, num_kv_heads, head_dim]``, ``v``: ``[n, num_kv_heads, v_head_dim]``, any float
        dtype (cast to the pool's). For fp8 pools the values are divided by ``k_scale``/``v_scale``
        (default: the layer's stored scale) before the cast, as SGLang does. Padded tokens may use
        slots of page 0.
        """
        self._require_unstriped("set_kv_buffer")
        index = self.layer_index(layer_id)
        check_slots(loc, self.num_slots)
        ks = self.k_scale[index] if k_scale is None else jnp.asarray(k_scale, jnp.float32)
        vs = self.v_scale[index] if v_scale is None else jnp.asarray(v_scale, jnp.float32)
        slots = route_to_trash(loc, self.num_slots)
        if slots.ndim != 1:
            raise ValueError(f"loc has shape {slots.shape}; expected [tokens], one slot per token")
        packed = self._pack(jnp.asarray(k), jnp.asarray(v), ks, vs, slots.shape[0])
        write = _write_slots
        if self.mesh is not None:
            axis = self.kv_head_axis
            write = jax.shard_map(
                write, mesh=self.mesh, in_specs=(_HEAD_SPEC(axis), P(None, axis, None), P()), out_specs=_HEAD_SPEC(axis)
            )
        return self.with_layer(index, write(self.kv[index], packed, slots))

    def set_kv_scale(self, layer_id: int, k_scale: float | jax.Array, v_scale: float | jax.Array) -> MHAKVPool:
        """Set one layer's fp8 scales (stored = value / scale). Existing entries are not rescaled.

        Concrete scales that are zero, negative or not finite raise ``ValueError`` (the pool is
        unchanged); traced scales cannot be checked.
        """
        index = self.layer_index(layer_id)
        check_kv_scale("k_scale", k_scale)
        check_kv_scale("v_scale", v_scale)
        return self.replace(
            k_scale=self.k_scale.at[index].set(jnp.float32(k_scale)),
            v_scale=self.v_scale.at[index].set(jnp.float32(v_scale)),
        )

    def move_kv_cache(self, tgt_loc: jax.Array, src_loc: jax.Array) -> MHAKVPool:
        """Copy token slots ``src_loc[i] -> tgt_loc[i]`` in every layer; return the new pool.

        All sources are read before any target is written (a chain ``1->2, 2->3`` copies the old
        slot 2 into 3).
        """
        self._require_unstriped("move_kv_cache")
        tgt, src = self.move_slots(tgt_loc, src_loc)
        copy = _copy_slots
        if self.mesh is not None:
            specs = tuple(_HEAD_SPEC(self.kv_head_axis) for _ in self.kv)
            copy = jax.shard_map(copy, mesh=self.mesh, in_specs=(specs, P(), P()), out_specs=specs)
        return self.replace(kv=copy(self.kv, src, tgt))

    # --- reads ----------------------------------------------------------------------------------

    def kv_buffer(self, layer_id: int) -> jax.Array:
        """The raw combined layer array in the logical dtype: ``[pages + 1, page_size, 2H, Dp]``.

        This is what paged-attention kernels read; it is a bit-cast, not a copy.
        """
        return dtypes.from_storage(self.kv[self.layer_index(layer_id)], self.logical_dtype)

    def get_key_buffer(self, layer_id: int) -> jax.Array:
        """K of one layer per token slot: ``[num_slots, num_kv_heads, head_dim]`` (stored values).

        A strided copy out of the interleaved layout (JAX has no views); prefer ``kv_buffer``
        inside kernels.
        """
        layer = self.kv_buffer(layer_id)
        return layer[:, :, 0::2, : self.head_dim].reshape(self.num_slots, self.num_kv_heads, self.head_dim)

    def get_value_buffer(self, layer_id: int) -> jax.Array:
        """V of one layer per token slot: ``[num_slots, num_kv_heads, v_head_dim]`` (stored values)."""
        layer = self.kv_buffer(layer_id)
        return layer[:, :, 1::2, : self.v_head_dim].reshape(self.num_slots, self.num_kv_heads, self.v_head_dim)

    def get_kv_buffer(self, layer_id: int) -> tuple[jax.Array, jax.Array]:
        """``(get_key_buffer(layer_id), get_value_buffer(layer_id))``."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_kv(self, layer_id: int, loc: jax.Array, *, dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array]:
        """Dequantised K and V of the given slots: ``[n, H, head_dim]``, ``[n, H, v_head_dim]`` in ``dtype``.

        Reads only the requested slots (O(n)); fp8 values are multiplied back by the layer's scale.
        """
        self._require_unstriped("get_kv")
        index = self.layer_index(layer_id)
        check_slots(loc, self.num_slots)
        slots = route_to_trash(loc, self.num_slots)
        layer = self.kv_buffer(layer_id)
        rows = layer.reshape(self.num_slots, 2 * self.num_kv_heads, self.head_dim_padded)[slots]
        k = rows[:, 0::2, : self.head_dim].astype(dtype)
        v = rows[:, 1::2, : self.v_head_dim].astype(dtype)
        if dtypes.is_fp8(self.dtype):
            k = k * self.k_scale[index].astype(dtype)
            v = v * self.v_scale[index].astype(dtype)
        return k, v

    def get_cpu_copy(self, loc: np.ndarray) -> list[np.ndarray]:
        """Host copies of the given slots of every layer (retraction with the ``cpu_tensor`` backup)."""
        self._require_unstriped("get_cpu_copy")
        check_slots(loc, self.num_slots)
        slots = jnp.asarray(loc, jnp.int32)
        return [np.asarray(jax.device_get(a.reshape(self.num_slots, *a.shape[2:])[slots])) for a in self.kv]

    def load_cpu_copy(self, copy: list[np.ndarray], loc: np.ndarray) -> MHAKVPool:
        """Write host copies made by ``get_cpu_copy`` back into the given slots; return the new pool."""
        check_slots(loc, self.num_slots)
        if len(copy) != self.num_layers:
            raise ValueError(f"copy has {len(copy)} layers; this pool has {self.num_layers}")
        slots = jnp.asarray(loc, jnp.int32)
        layers = tuple(_write_slots(a, jnp.asarray(c, a.dtype), slots) for a, c in zip(self.kv, copy, strict=True))
        return self.replace(kv=layers)


def create_pool(pool: PoolPlan, context: BuildContext) -> MHAKVPool:
    """The pool kind registry's builder for ``"mha"``: allocate the pool ``pool`` plans.

    Consecutive layers are indexed from ``layer_ids[0]``; interleaved ones (the full-attention
    layers of a hybrid model) through ``layer_ids``.
    """
    start, layer_ids = planned_layers(pool)
    return pool_from_plan(pool, context, "mha", start_layer=start, layer_ids=layer_ids)


def pool_from_plan(
    pool: PoolPlan,
    context: BuildContext,
    kind: str,
    *,
    start_layer: int = 0,
    layer_ids: tuple[int, ...] | None = None,
) -> MHAKVPool:
    """An ``MHAKVPool`` of the pages, layers and layout ``pool`` plans (``kind``: the plan's pool
    kind, for the error when its layout is not an ``MHALayout``).

    The plan's heads are per rank; with a mesh the global array holds ``tp_size`` times as many,
    sharded over ``context.kv_head_axis``. Under DCP the plan's page rows are one device's: the
    global page holds ``dcp_size`` times as many, sharded over ``context.context_axis``.
    """
    layout = planned_layout(pool, kind, MHALayout)
    heads = layout.num_kv_heads * (context.tp_size if context.mesh is not None else 1)
    striped = context.mesh is not None and context.context_axis is not None
    return MHAKVPool.create(
        num_pages=pool.shape[0] - 1,
        page_size=layout.page_size * (context.dcp_size if striped else 1),
        num_layers=pool.count,
        num_kv_heads=heads,
        head_dim=layout.head_dim,
        v_head_dim=layout.v_head_dim,
        dtype=layout.dtype,
        platform=context.platform,
        head_dim_alignment=layout.head_dim_padded,  # rounds max(head_dim, v_head_dim) up to exactly it
        start_layer=start_layer,
        mesh=context.mesh,
        kv_head_axis=context.kv_head_axis,
        layer_ids=layer_ids,
        context_axis=context.context_axis if striped else None,
    )


def _HEAD_SPEC(axis: str | None, context_axis: str | None = None) -> P:  # noqa: N802 - reads as a constant spec
    """Layer arrays sharded over the combined K/V head axis (and, under decode context
    parallelism, each page's token rows over ``context_axis``)."""
    return P(None, context_axis, axis, None)
