"""`SWAKVPool`: the KV pools of a hybrid sliding-window model (SGLang's ``SWAKVPool``).

Two :class:`~kvjax.pools.mha.MHAKVPool` s in the MHA layout, each with its own trash page 0:

* ``full``: the full-attention layers, ``full_tokens_per_layer`` slots (None when every layer is
  sliding);
* ``swa``: the sliding-window layers, ``swa_tokens_per_layer`` slots.

The model addresses every layer by its global id and every token by its *full* slot id (what the
allocator hands out and the request table holds). A sliding layer's slot is
``full_to_swa[loc]`` (the allocator's mapping, ``SWATokenToKVPoolAllocator.device_mapping()``),
passed in by the caller: the mapping changes on the host every step, so it is an input of the
step rather than donated device state. With no full layers (pure SWA) the allocator hands out SWA
slots directly and no mapping is used.

Bounds: concrete full slot ids are checked on the host (``InvalidSlotError``); inside a trace, ids
outside the mapping, and mapped ids outside the SWA pool, are routed to slot 0 (the SWA pool's
trash page), never clamped onto a live slot. An unpaired slot (mapping 0) writes to the trash page.
Every update returns a new pool; under ``jax.jit`` with the pool donated it is in place (only the
written layer's buffer changes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.errors import InvalidSlotError
from kvjax.layout.build_context import BuildContext
from kvjax.layout.pool_plan import PoolPlan
from kvjax.pools.base import Pool, check_slots, static_field
from kvjax.pools.mha import MHAKVPool, pool_from_plan

__all__ = ["SWAKVPool", "create_pool_group", "translate_full_to_swa"]


def translate_full_to_swa(loc: jax.Array, full_to_swa: jax.Array, num_swa_slots: int) -> jax.Array:
    """SWA slot ids of full slot ids ``loc`` (int32, on device).

    ``full_to_swa``: the allocator's mapping (``size_full + page_size + 1`` entries, the last -1).
    Ids outside ``[0, len(full_to_swa) - 1)`` and mapped ids outside ``[0, num_swa_slots)`` give 0,
    the trash slot; so does an unpaired slot (mapping 0).
    """
    loc = jnp.asarray(loc).astype(jnp.int32)
    n = full_to_swa.shape[0] - 1  # the last entry (-1) is for last_loc == -1, never a slot
    inside = (loc >= 0) & (loc < n)
    swa = jnp.asarray(full_to_swa)[jnp.where(inside, loc, 0)].astype(jnp.int32)
    return jnp.where(inside & (swa >= 0) & (swa < num_swa_slots), swa, 0)


class SWAKVPool(Pool):
    """The full-attention pool and the sliding-window pool of one pipeline stage.

    Data fields (pytree children): ``full`` (an ``MHAKVPool`` over the full layers, or None) and
    ``swa`` (an ``MHAKVPool`` over the sliding layers); each sub-pool indexes its layers locally
    (0, 1, ...). Static: ``full_layer_ids`` and ``swa_layer_ids``, the global layer ids in the
    sub-pools' order.
    """

    full: MHAKVPool | None
    swa: MHAKVPool
    full_layer_ids: tuple[int, ...] = static_field()
    swa_layer_ids: tuple[int, ...] = static_field()

    # --- layers ---------------------------------------------------------------------------------

    @property
    def layers_mapping(self) -> dict[int, tuple[int, bool]]:
        """Global layer id -> (index in its sub-pool, is_swa) (SGLang's ``layers_mapping``)."""
        out = {g: (i, False) for i, g in enumerate(self.full_layer_ids)}
        out.update({g: (i, True) for i, g in enumerate(self.swa_layer_ids)})
        return out

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether ``layer_id`` is a sliding-window layer of this pool (InvalidSlotError if neither)."""
        return self._locate(layer_id)[1]

    def _locate(self, layer_id: int) -> tuple[int, bool]:
        if layer_id in self.swa_layer_ids:
            return self.swa_layer_ids.index(layer_id), True
        if layer_id in self.full_layer_ids:
            return self.full_layer_ids.index(layer_id), False
        raise InvalidSlotError(
            f"layer_id={layer_id} is not in this pool (full layers {list(self.full_layer_ids)}, "
            f"sliding layers {list(self.swa_layer_ids)})"
        )

    @property
    def page_size(self) -> int:
        return self.swa.page_size

    @property
    def num_full_slots(self) -> int:
        """Valid full slot ids are ``[0, num_full_slots)`` (the SWA pool's when there is no full pool)."""
        return self.full.num_slots if self.full is not None else self.swa.num_slots

    def nbytes(self) -> int:
        return self.swa.nbytes() + (self.full.nbytes() if self.full is not None else 0)

    def swa_loc(self, loc: Any, full_to_swa: Any) -> jax.Array:
        """The SWA slots of full slots ``loc`` (identity without a full pool)."""
        if self.full is None:
            return jnp.asarray(loc).astype(jnp.int32)
        if full_to_swa is None:
            raise ValueError(
                "a sliding layer's slots go through the full->SWA mapping: pass full_to_swa "
                "(the allocator's device_mapping())"
            )
        return translate_full_to_swa(loc, jnp.asarray(full_to_swa), self.swa.num_slots)

    # --- writes and reads -----------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: Any,
        k: jax.Array,
        v: jax.Array,
        k_scale: float | jax.Array | None = None,
        v_scale: float | jax.Array | None = None,
        *,
        full_to_swa: Any = None,
    ) -> SWAKVPool:
        """Write ``k``/``v`` of tokens at full slots ``loc`` into layer ``layer_id``; a sliding
        layer writes at ``full_to_swa[loc]`` (required then, unless the model has no full layers).
        Returns the new pool; the other sub-pool is untouched."""
        index, is_swa = self._locate(layer_id)
        check_slots(loc, self.num_full_slots)
        if is_swa:
            swa = self.swa.set_kv_buffer(index, self.swa_loc(loc, full_to_swa), k, v, k_scale, v_scale)
            return self.replace(swa=swa)
        assert self.full is not None
        return self.replace(full=self.full.set_kv_buffer(index, loc, k, v, k_scale, v_scale))

    def kv_buffer(self, layer_id: int) -> jax.Array:
        """The raw layer array a paged-attention kernel reads (its own sub-pool's pages)."""
        pool, index = self.sub_pool(layer_id)
        return pool.kv_buffer(index)

    def sub_pool(self, layer_id: int) -> tuple[MHAKVPool, int]:
        """``(the MHAKVPool holding layer_id, its local index)``."""
        index, is_swa = self._locate(layer_id)
        pool = self.swa if is_swa else self.full
        assert pool is not None
        return pool, index

    def get_kv(
        self, layer_id: int, loc: Any, *, full_to_swa: Any = None, dtype: Any = jnp.float32
    ) -> tuple[jax.Array, jax.Array]:
        """Dequantised K and V of full slots ``loc`` in layer ``layer_id`` (sliding: through the mapping)."""
        index, is_swa = self._locate(layer_id)
        check_slots(loc, self.num_full_slots)
        if is_swa:
            return self.swa.get_kv(index, self.swa_loc(loc, full_to_swa), dtype=dtype)
        assert self.full is not None
        return self.full.get_kv(index, loc, dtype=dtype)


def create_pool_group(pools: tuple[PoolPlan, ...], context: BuildContext) -> SWAKVPool:
    """The pool kind registry's group builder for ``"swa"``: the plan's ``kv_full`` (optional) and
    ``kv_swa`` pools as one :class:`SWAKVPool`, each sized as planned, with its trash page."""
    by_name = {p.name: p for p in pools}
    unknown = set(by_name) - {"kv_full", "kv_swa"}
    if unknown or "kv_swa" not in by_name:
        raise ValueError(f"the 'swa' pool group takes kv_full (optional) and kv_swa, got {sorted(by_name)}")
    full_plan = by_name.get("kv_full")
    swa_plan = by_name["kv_swa"]
    return SWAKVPool(
        full=None if full_plan is None else pool_from_plan(full_plan, context, "swa"),
        swa=pool_from_plan(swa_plan, context, "swa"),
        full_layer_ids=() if full_plan is None else tuple(full_plan.layer_ids),
        swa_layer_ids=tuple(swa_plan.layer_ids),
    )
