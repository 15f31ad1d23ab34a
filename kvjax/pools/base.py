"""What every device pool shares: a frozen dataclass registered as a JAX pytree, layer addressing,
the paged facts, and the slot-id checks.

* :class:`Pool` is the base of every pool (``MHAKVPool``, ``MLAKVPool``, ``DSAIndexerKeyPool``,
  ``SWAKVPool``, ``RecurrentStatePool``). A subclass is made a frozen dataclass and registered
  with ``jax.tree_util.register_dataclass`` when it is defined: fields made with
  :func:`static_field` are pytree metadata (static under ``jit``: part of a compiled step's cache
  key and of the tree structure ``CachePools`` checks), every other field is a leaf (or a pytree
  of leaves). Fields keep their declaration order, so the leaves and the positional constructor
  are exactly those of the class body. :meth:`Pool.replace` is the functional update.
* :class:`LayerStack` (a mixin) addresses layers by global id: consecutive from ``start_layer``, or
  listed in ``layer_ids`` (the interleaved layers of a hybrid model, SGLang's
  ``HybridLinearKVPool`` mapping). :class:`PagedLayers` adds the facts of one array per layer
  whose axis 0 is pages, page 0 the trash page.
* :func:`check_slots` (host-side) and :func:`route_to_trash` (device-side) are the two halves of
  the slot-id contract: concrete ids outside the pool raise ``InvalidSlotError``; traced ones are
  routed to slot 0, never clamped onto a live slot.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Self, dataclass_transform

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.errors import InvalidSlotError

__all__ = [
    "LayerStack",
    "PagedLayers",
    "Pool",
    "check_slots",
    "is_traced",
    "route_to_trash",
    "static_field",
    "zeroed_layers",
]


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is pytree metadata (static under ``jit``), not a leaf.

    Takes ``dataclasses.field``'s keyword arguments (``default=...``).
    """
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, static_field))
class Pool:
    """Base of every device pool: each subclass is a frozen dataclass and a registered pytree.

    Subclasses declare their fields in the class body as for ``@dataclasses.dataclass(frozen=True)``
    (leaves plain, metadata with :func:`static_field`); this base adds no field.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        jax.tree_util.register_dataclass(cls)

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed (the pytree analogue of an in-place update)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


class LayerStack:
    """Mixin: a pool's layers addressed by global layer id.

    The pool's layers are consecutive from ``start_layer``, unless ``layer_ids`` lists them (array
    order). Pools whose dataclass declares those fields override the defaults below;
    ``LAYER_KIND`` names the layers in errors ("full attention", "recurrent").
    """

    LAYER_KIND: ClassVar[str] = ""
    start_layer: int = 0
    layer_ids: tuple[int, ...] | None = None

    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    def layer_index(self, layer_id: int) -> int:
        """The array index of global layer ``layer_id``; ``InvalidSlotError`` (a ``ValueError``)
        naming this pool's layers when it is not here."""
        if self.layer_ids is not None:
            try:
                return self.layer_ids.index(int(layer_id))
            except ValueError:
                raise InvalidSlotError(
                    f"layer_id={layer_id} not in {self.LAYER_KIND} layers: {list(self.layer_ids)}"
                ) from None
        index = layer_id - self.start_layer
        if not 0 <= index < self.num_layers:
            raise InvalidSlotError(
                f"layer_id={layer_id} is not in this pool (layers {self.start_layer}.."
                f"{self.start_layer + self.num_layers - 1})"
            )
        return index


class PagedLayers(LayerStack):
    """Mixin: one array per layer in the dataclass field named ``LAYERS_FIELD``, axis 0 its
    ``num_pages + 1`` pages (page 0 the trash page), each page ``page_size`` token slots."""

    LAYERS_FIELD: ClassVar[str] = "kv"
    HOST_COPYABLE: ClassVar[bool] = False
    """Whether the host tier and the retraction backup copy this pool's pages
    (``kvjax.transfers.device_pages``): each page a host pool's page row."""
    page_size: int

    @property
    def layer_arrays(self) -> tuple[jax.Array, ...]:
        """The per-layer arrays, in layer order."""
        arrays: tuple[jax.Array, ...] = getattr(self, self.LAYERS_FIELD)
        return arrays

    def with_layer(self, index: int, layer: jax.Array) -> Self:
        """A copy with the array of layer ``index`` (array index, see ``layer_index``) replaced."""
        layers = list(self.layer_arrays)
        layers[index] = layer
        return dataclasses.replace(self, **{self.LAYERS_FIELD: tuple(layers)})  # type: ignore[type-var]

    @property
    def num_layers(self) -> int:
        return len(self.layer_arrays)

    @property
    def num_pages(self) -> int:
        """Allocatable pages (the trash page excluded)."""
        return self.layer_arrays[0].shape[0] - 1

    @property
    def size(self) -> int:
        """Allocatable token slots: ``num_pages * page_size`` (SGLang's pool ``size``)."""
        return self.num_pages * self.page_size

    @property
    def num_slots(self) -> int:
        """All token slots including the trash page: valid slot ids are ``[0, num_slots)``."""
        return (self.num_pages + 1) * self.page_size

    @property
    def store_dtype(self) -> np.dtype:
        """The dtype the layer arrays are stored as."""
        return np.dtype(self.layer_arrays[0].dtype)

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers of this pool (padding included)."""
        layer = self.layer_arrays[0]
        return self.num_layers * math.prod(layer.shape[1:]) * layer.dtype.itemsize // self.page_size

    def move_slots(self, tgt_loc: Any, src_loc: Any) -> tuple[jax.Array, jax.Array]:
        """The ``(tgt, src)`` int32 slot ids of a ``move_kv_cache``: concrete ids checked on the host
        (``InvalidSlotError``), both 1-D of one length (``ValueError``), traced ids outside the
        pool routed to the trash page (a target there is dropped)."""
        check_slots(tgt_loc, self.num_slots, name="tgt_loc")
        check_slots(src_loc, self.num_slots, name="src_loc")
        tgt = route_to_trash(tgt_loc, self.num_slots)
        src = route_to_trash(src_loc, self.num_slots)
        if tgt.shape != src.shape or tgt.ndim != 1:
            raise ValueError(f"tgt_loc {tgt.shape} and src_loc {src.shape} must be 1-D of equal length")
        return tgt, src

    def nbytes(self) -> int:
        """Bytes of all layer arrays (trash page included)."""
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in self.layer_arrays)


def is_traced(x: Any) -> bool:
    """Whether ``x`` is an abstract value inside a trace (its ids cannot be checked on the host)."""
    return isinstance(x, jax.core.Tracer)


def check_traced_ids(ids: Any, bound: int, name: str) -> None:
    """A ``checkify.debug_check`` that every id of ``ids`` lies in ``[0, bound)``: under
    ``jax.experimental.checkify.checkify`` an id out of range is reported by value
    (``err.throw()``); elsewhere it is dropped at lowering. Only for steps that asked for it
    (``AttentionMetadata.with_checks``): a check is a JAX effect, and a jitted function with an
    effect loses JAX's fast dispatch path (about 60 us more per call on this CPU)."""
    traced = jnp.asarray(ids)
    outside = (traced < 0) | (traced >= bound)
    checkify.debug_check(
        ~jnp.any(outside),
        f"{name}: id {{}} is outside [0, {bound}); pass ids from this pool's allocator",
        traced.ravel()[jnp.argmax(outside.ravel())],
    )


def check_slots(loc: Any, num_slots: int, *, name: str = "loc") -> None:
    """Reject concrete slot ids outside ``[0, num_slots)`` on the host; traced ids (inside the
    caller's ``jit``) pass through, and ``route_to_trash`` drops those out of range (a step whose
    metadata asked for checks reports them: ``check_traced_ids``).

    Raises ``InvalidSlotError`` naming the first offending ids and how many there are.
    """
    if is_traced(loc):
        return
    ids = np.asarray(loc)
    if ids.dtype.kind not in "iu":
        raise InvalidSlotError(f"{name} must be integer slot ids, got dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= num_slots)]
    if bad.size:
        raise InvalidSlotError(
            f"{name}: {bad.size} slot id(s) outside [0, {num_slots}): {bad[:8].tolist()}"
            f"{' ...' if bad.size > 8 else ''}; pass slot ids from this pool's allocator"
        )


def route_to_trash(loc: Any, num_slots: int) -> jax.Array:
    """Device-side guard: ``loc`` as int32 with every id outside ``[0, num_slots)`` set to 0 (the
    trash page, or the padding slot of a state pool)."""
    loc = jnp.asarray(loc).astype(jnp.int32)
    return jnp.where((loc >= 0) & (loc < num_slots), loc, 0)


def zeroed_layers(
    num_layers: int, shape: tuple[int, ...], dtype: Any, mesh: Mesh | None = None, spec: P | None = None
) -> tuple[jax.Array, ...]:
    """``num_layers`` zeroed arrays of ``shape`` and ``dtype``, each created directly on its
    device(s) (no host staging), one at a time; with a ``mesh``, laid out as ``spec`` over it
    (default: replicated)."""
    sharding = None if mesh is None else NamedSharding(mesh, P() if spec is None else spec)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return tuple(zeros() for _ in range(num_layers))
