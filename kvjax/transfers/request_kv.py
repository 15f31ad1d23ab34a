"""`RequestKV`: how one pool's share of a request's cache is read out and written in, for moving it
between servers (prefill/decode disaggregation, ``kvjax.disaggregation``).

A request's cache on a server is, per pool kind:

* a paged pool (``MHAKVPool``, ``MLAKVPool``, a draft model's pool): one row per token and layer,
  at the token's slot;
* the sliding-window pair (``SWAKVPool``): the full side's rows for every token and the window
  side's rows for the tokens still in the window;
* the recurrent state (``RecurrentStatePool``): one state slot, the state after the request's
  last token.

Each pool kind registers its ``RequestKV`` with its pool builders (``PoolBuilders.request_kv``,
``kvjax.pools.registry``), and the transfer code only walks the cache's pools and asks each one
(no branch per kind there). A ``RequestKV`` turns a pool and a :class:`RequestSpan` (the token
range and where those tokens live on this side) into *pieces*: device arrays in a layout that does
not depend on the side's page size or tensor-parallel size, and writes pieces into the other
side's pool at that side's slots. Layout of the pieces (``PieceSpec`` says each one's shape):

* paged layers: ``[layers, tokens, *row]`` in the storage dtype (MLA's latent: ``row = [width]``,
  replicated over a mesh; the DSA indexer keys: ``row = [D + D // 128 * 4]`` uint8, each token's fp8
  key bytes then its scales' bytes); for MHA ``row = [C, D]``, ``C = 2 * kv_heads``
  with each distinct KV head once (a pool whose TP size exceeds the model's KV heads holds each
  head on several ranks: its copies are dropped on the way out and made again on the way in),
  and the fp8 scales ``[layers]`` f32;
* recurrent state: ``[layers, 1, *state]`` per tensor (conv tensors and the SSM state), the
  logical (unpacked) shapes.

Invariants: ``gather`` reads only the request's slots and ``scatter`` writes only them, each
O(tokens moved) (the pool is donated to the jitted write: in place, ``pallas_kernels.kv_write``);
pieces carry no page structure, so page sizes may differ between the sides; a pool whose token
rows are striped over a decode-context-parallel axis is refused (``NotImplementedError``). A kind
whose pieces' layout depends on more than their shapes says so in an optional ``layout(pool)``
(strings both sides' signatures carry: the recurrent state's TP split).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from kvjax.errors import InvalidSlotError
from kvjax.pools import dtypes
from kvjax.pools.base import route_to_trash
from kvjax.pools.mla import scatter_rows
from kvjax.pools.recurrent import _STATE_SPEC, state_axis_size
from pallas_kernels.kv_write import write_kv

__all__ = [
    "PieceSpec",
    "PagedRequestKV",
    "RecurrentRequestKV",
    "RequestKV",
    "RequestSpan",
    "SWARequestKV",
]


@dataclasses.dataclass(frozen=True)
class RequestSpan:
    """Where tokens ``[start, end)`` of one request live on one side.

    ``slots``: the full-attention slot of each token (``end - start`` ids, what the request table
    holds); ``window_start``: the first token the sliding-window layers move (>= ``start``);
    ``swa_slots``: the window side's slot of each token of ``[window_start, end)`` (None without
    sliding layers); ``state_slot``: the request's recurrent-state slot (None without one).
    """

    start: int
    end: int
    slots: np.ndarray
    window_start: int = 0
    swa_slots: np.ndarray | None = None
    state_slot: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"RequestSpan: tokens [{self.start}, {self.end}) are not a range")
        if len(self.slots) != self.end - self.start:
            raise ValueError(f"RequestSpan: {len(self.slots)} slots for the {self.end - self.start} tokens")

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def window_tokens(self) -> int:
        return self.end - max(self.window_start, self.start)


@dataclasses.dataclass(frozen=True)
class PieceSpec:
    """One piece of a pool's share: ``name`` (unique in the pool), ``shape``, ``dtype`` (its
    string); ``head_axis``: the axis that may be split over devices on the way (None: moved whole,
    on one device); ``token_axis``: the axis of the span's tokens (None: per request, not per
    token); ``window``: its tokens are the span's window tokens ``[window_start, end)``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    head_axis: int | None = None
    token_axis: int | None = None
    window: bool = False

    def struct(self, sharding: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, jnp.dtype(self.dtype), sharding=sharding)


class RequestKV(Protocol):
    """A pool kind's way of moving a request's share of its pool (see the module docstring)."""

    def pieces(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[PieceSpec, ...]:
        """What ``gather`` gives and ``scatter`` takes for ``span`` (``kv_heads``: the model's
        distinct KV heads)."""
        ...

    def gather(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[jax.Array, ...]:
        """The pieces of tokens ``span`` of ``pool`` (device arrays; the pool is only read)."""
        ...

    def scatter(self, pool: Any, pieces: Sequence[jax.Array], span: RequestSpan, kv_heads: int) -> Any:
        """``pool`` with ``pieces`` written at ``span``'s slots (the pool is donated)."""
        ...


def _refuse_striped(pool: Any) -> None:
    if getattr(pool, "context_axis", None) is not None:
        raise NotImplementedError(
            f"a {type(pool).__name__} striped over the decode-context-parallel axis {pool.context_axis!r} cannot be "
            "moved between servers yet; serve the disaggregated sides without --dcp"
        )


def _slots_array(slots: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(slots, np.int32))


# --- paged layers -----------------------------------------------------------------------------------


def _replicas(pool: Any, kv_heads: int) -> int:
    """Ranks holding each KV head in an MHA pool (1 for a pool without heads to regroup)."""
    heads = getattr(pool, "num_kv_heads", None)
    if heads is None or heads <= kv_heads:
        return 1
    if heads % kv_heads:
        raise ValueError(f"the pool holds {heads} KV heads, not a multiple of the model's {kv_heads}")
    return heads // kv_heads


@functools.partial(jax.jit, static_argnames=("replicas",))
def _gather_rows(layers: tuple[jax.Array, ...], slots: jax.Array, replicas: int) -> jax.Array:
    """``[layers, tokens, C / replicas, D]``: each layer's rows at ``slots``, each head once."""
    out = []
    for layer in layers:
        rows = layer.reshape(-1, *layer.shape[2:])[slots]
        if replicas > 1:
            n, c, d = rows.shape
            rows = rows.reshape(n, c // (2 * replicas), replicas, 2, d)[:, :, 0].reshape(n, c // replicas, d)
        out.append(rows)
    return jnp.stack(out)


def _expand_heads(rows: jax.Array, replicas: int) -> jax.Array:
    """``[n, 2G, D]`` -> ``[n, 2G * replicas, D]``: each head's K/V pair repeated ``replicas`` times."""
    if replicas == 1:
        return rows
    n, c, d = rows.shape
    pairs = rows.reshape(n, c // 2, 1, 2, d)
    return jnp.broadcast_to(pairs, (n, c // 2, replicas, 2, d)).reshape(n, c * replicas, d)


def _head_axis(pool: Any) -> str | None:
    """The mesh axis the pool's head axis (axis 2 of each layer) is split over, or None (no mesh,
    or every layer replicated over it: the MLA latent)."""
    if getattr(pool, "mesh", None) is None or getattr(pool, "num_kv_heads", None) is None:
        return None
    axis: str | None = getattr(pool, "kv_head_axis", None)
    return axis


def _row_writer(pool: Any) -> Any:
    """``write(layer, rows [n, *row], slots) -> layer`` for one layer array of ``pool``: the KV
    write of ``[pages, page_size, C, D]`` layers (per device under ``shard_map`` when the pool's
    heads are split over a mesh), the row scatter of ``[pages, page_size, row]`` ones (the MLA
    latent, replicated)."""
    if pool.layer_arrays[0].ndim == 3:
        return scatter_rows
    axis = _head_axis(pool)
    if axis is None:
        return write_kv
    layer_spec = P(None, None, axis, None)
    return jax.shard_map(
        write_kv, mesh=pool.mesh, in_specs=(layer_spec, P(None, axis, None), P()), out_specs=layer_spec, check_vma=False
    )


def _layer_sharding(pool: Any) -> Any:
    """Where the pieces of ``pool`` must lie before its write (the pool's devices)."""
    layer = pool.layer_arrays[0]
    mesh = getattr(pool, "mesh", None)
    if mesh is None:
        return SingleDeviceSharding(next(iter(layer.devices())))
    axis = _head_axis(pool)
    if axis is None:
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(None, None, axis, None))


@functools.partial(jax.jit, static_argnames=("writer", "replicas"), donate_argnums=(0,))
def _scatter_rows(
    layers: tuple[jax.Array, ...], rows: jax.Array, slots: jax.Array, writer: Any, replicas: int
) -> tuple[jax.Array, ...]:
    return tuple(writer(layer, _expand_heads(rows[i], replicas), slots) for i, layer in enumerate(layers))


class PagedRequestKV:
    """``RequestKV`` of a ``PagedLayers`` pool (MHA, MLA, a draft model's MHA pool): the rows of
    tokens ``span.slots`` of every layer, and the pool's per-layer scales (``SCALE_FIELDS``)."""

    SCALE_FIELDS = ("k_scale", "v_scale", "scale")

    def __init__(self, window: bool = False) -> None:
        # window: this pool holds only the sliding window's tokens (the SWA pair's window side)
        self.window = window

    def _slots(self, span: RequestSpan) -> np.ndarray:
        if not self.window:
            return _slots_array(span.slots)
        if span.swa_slots is None:
            raise ValueError("a sliding-window pool's span needs swa_slots")
        return _slots_array(span.swa_slots)

    def _scales(self, pool: Any) -> tuple[str, ...]:
        return tuple(f for f in self.SCALE_FIELDS if hasattr(pool, f))

    def pieces(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[PieceSpec, ...]:
        _refuse_striped(pool)
        layer = pool.layer_arrays[0]
        if _is_indexer(pool):  # each token's key bytes, then its scale bytes
            n = span.window_tokens if self.window else span.tokens
            return (PieceSpec("rows", (pool.num_layers, n, pool.bytes_per_token_per_layer), "uint8", None, 1),)
        row = list(layer.shape[2:])
        has_heads = getattr(pool, "num_kv_heads", None) is not None
        if has_heads:
            row[0] //= _replicas(pool, kv_heads)
        n = span.window_tokens if self.window else span.tokens
        rows = PieceSpec(
            "rows", (len(pool.layer_arrays), n, *row), str(layer.dtype), 2 if has_heads else None, 1, self.window
        )
        scales = tuple(PieceSpec(f, tuple(getattr(pool, f).shape), "float32") for f in self._scales(pool))
        return (rows, *scales)

    def gather(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[jax.Array, ...]:
        _refuse_striped(pool)
        if _is_indexer(pool):
            return (_gather_index_k(pool, jnp.asarray(self._slots(span))),)
        rows = _gather_rows(tuple(pool.layer_arrays), jnp.asarray(self._slots(span)), _replicas(pool, kv_heads))
        # the scales are copied: the pool's own arrays are donated into the next step
        return (rows, *(jnp.copy(getattr(pool, f)) for f in self._scales(pool)))

    def scatter(self, pool: Any, pieces: Sequence[jax.Array], span: RequestSpan, kv_heads: int) -> Any:
        _refuse_striped(pool)
        rows, *scales = pieces
        rows = jax.device_put(rows, _layer_sharding(pool))
        slots = jax.device_put(self._slots(span), _replicated(rows))
        if _is_indexer(pool):
            return _scatter_index_k(pool, rows, slots)
        layers = _scatter_rows(tuple(pool.layer_arrays), rows, slots, _row_writer(pool), _replicas(pool, kv_heads))
        updates = {pool.LAYERS_FIELD: layers}
        for name, value in zip(self._scales(pool), scales, strict=True):
            old = getattr(pool, name)
            updates[name] = jax.device_put(value, old.sharding)
        return pool.replace(**updates)


def _is_indexer(pool: Any) -> bool:
    """A DSA indexer key pool (``DSAIndexerKeyPool``): each page's bytes hold its tokens' fp8 keys,
    then their scales, so a token's row is not a slice of the layer."""
    return hasattr(pool, "get_index_k_and_scale")


def _layer_id(pool: Any, index: int) -> int:
    ids = getattr(pool, "layer_ids", None)
    return int(ids[index]) if ids is not None else int(pool.start_layer) + index


@jax.jit
def _gather_index_k(pool: Any, slots: jax.Array) -> jax.Array:
    """``[layers, n, D + D // 128 * 4]`` uint8: each token's key bytes, then its scales' bytes."""
    out = []
    for i in range(pool.num_layers):
        keys, scale = pool.get_index_k_and_scale(_layer_id(pool, i), slots)
        scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(keys.shape[0], -1)
        out.append(jnp.concatenate([keys.view(jnp.uint8), scale_bytes], axis=1))
    return jnp.stack(out)


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_index_k(pool: Any, rows: jax.Array, slots: jax.Array) -> Any:
    """``pool`` with ``rows`` (:func:`_gather_index_k`'s layout) at ``slots`` (the pool donated)."""
    d, n = pool.index_head_dim, rows.shape[1]
    for i in range(pool.num_layers):
        scale = jax.lax.bitcast_convert_type(rows[i][:, d:].reshape(n, -1, 4), jnp.float32)
        pool = pool.set_index_k_and_scale(_layer_id(pool, i), slots, rows[i][:, :d], scale)
    return pool


def _replicated(like: jax.Array) -> Any:
    sharding = like.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P())
    return sharding


# --- the sliding-window pair --------------------------------------------------------------------------


class SWARequestKV:
    """``RequestKV`` of an ``SWAKVPool``: its full side's rows of every token (``full.*``) and its
    window side's rows of the tokens in the window (``swa.*``)."""

    def __init__(self) -> None:
        self.full = PagedRequestKV()
        self.swa = PagedRequestKV(window=True)

    def _sides(self, pool: Any) -> list[tuple[str, PagedRequestKV, Any]]:
        sides = [("swa", self.swa, pool.swa)]
        if pool.full is not None:
            sides.insert(0, ("full", self.full, pool.full))
        return sides

    def pieces(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[PieceSpec, ...]:
        out = []
        for side, kv, sub in self._sides(pool):
            # a pure sliding-window pool's allocator hands out window slots directly
            sub_span = span if pool.full is not None else _pure_window(span)
            out += [dataclasses.replace(p, name=f"{side}.{p.name}") for p in kv.pieces(sub, sub_span, kv_heads)]
        return tuple(out)

    def gather(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[jax.Array, ...]:
        sub_span = span if pool.full is not None else _pure_window(span)
        return tuple(a for _, kv, sub in self._sides(pool) for a in kv.gather(sub, sub_span, kv_heads))

    def scatter(self, pool: Any, pieces: Sequence[jax.Array], span: RequestSpan, kv_heads: int) -> Any:
        sub_span = span if pool.full is not None else _pure_window(span)
        rest = list(pieces)
        updates = {}
        for side, kv, sub in self._sides(pool):
            count = len(kv.pieces(sub, sub_span, kv_heads))
            updates[side] = kv.scatter(sub, rest[:count], sub_span, kv_heads)
            rest = rest[count:]
        return pool.replace(**updates)


def _pure_window(span: RequestSpan) -> RequestSpan:
    """A pure sliding-window model's span: its window slots are its only slots."""
    if span.swa_slots is not None:
        return span
    first = max(span.window_start, span.start) - span.start
    return dataclasses.replace(span, swa_slots=np.asarray(span.slots)[first:])


# --- recurrent state ------------------------------------------------------------------------------------


class RecurrentRequestKV:
    """``RequestKV`` of a ``RecurrentStatePool``: the request's state slot, every tensor
    (``conv.<i>`` and ``ssm``) of every layer, in the logical shapes and dtypes.

    Read and written in one jitted call each over all layers (the write donates the pool's arrays:
    in place, O(one slot)); over a mesh the write runs per device under ``shard_map`` on the
    pool's own sharding (``_STATE_SPEC``: the channel / head axis split), and lane-dense conv
    storage (TPU) is converted on the way in and out.

    A sharded pool's global conv channel axis is its ranks' channels concatenated (each rank's
    projection groups, rank-major), so its order depends on the TP size: :meth:`layout` says it,
    and the handshake refuses two sides whose recurrent state is split over different TP sizes
    (the SSM tensor's head axis would move, the conv tensors' could not without the model's
    channel groups)."""

    def _names(self, pool: Any) -> list[str]:
        return [*(f"conv.{i}" for i in range(len(pool.conv))), "ssm"]

    def _slot(self, pool: Any, span: RequestSpan) -> np.ndarray:
        if span.state_slot is None:
            raise ValueError("the request holds no recurrent-state slot to move")
        slot = int(span.state_slot)
        if not 1 <= slot <= pool.num_slots:
            raise InvalidSlotError(f"state slot {slot} is outside [1, {pool.num_slots}] (the pool's slots)")
        return np.asarray([slot], np.int32)

    def layout(self, pool: Any) -> tuple[str, ...]:
        """What both sides must share beyond the pieces' shapes: the TP size the state's channel
        and head axes are split over (it orders the global conv channels)."""
        ranks = 1 if pool.mesh is None else state_axis_size(pool.mesh, pool.state_axis)
        return (f"recurrent state split over tp={ranks}",)

    def pieces(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[PieceSpec, ...]:
        layers = pool.num_layers
        shapes = [*pool.conv_state_shapes, pool.ssm_state_shape]
        logical = pool._logical_dtypes()
        return tuple(
            PieceSpec(n, (layers, 1, *shape), str(jnp.dtype(dt)))
            for n, shape, dt in zip(self._names(pool), shapes, logical, strict=True)
        )

    def gather(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[jax.Array, ...]:
        slot = self._slot(pool, span)
        out = _read_slot(pool.arrays(), jnp.asarray(slot), pool._logical_dtypes())
        if pool.mesh is not None:  # one slot: whole, on one device (the pieces travel so)
            first = SingleDeviceSharding(pool.mesh.devices.flat[0])
            out = tuple(jax.device_put(x, first) for x in out)
        conv = tuple(_conv_from_storage(pool, i, x) for i, x in enumerate(out[:-1]))
        return (*conv, out[-1])

    def scatter(self, pool: Any, pieces: Sequence[jax.Array], span: RequestSpan, kv_heads: int) -> Any:
        slot = self._slot(pool, span)
        specs = self.pieces(pool, span, kv_heads)
        if len(pieces) != len(specs):
            raise ValueError(f"{len(pieces)} recurrent-state pieces given; this pool takes {len(specs)}")
        for spec, piece in zip(specs, pieces, strict=True):
            if tuple(piece.shape) != spec.shape:
                raise ValueError(
                    f"recurrent-state piece {spec.name!r} has shape {tuple(piece.shape)}; expected {spec.shape}"
                )
        new = [_conv_to_storage(pool, i, p) for i, p in enumerate(pieces[:-1])] + [pieces[-1]]
        arrays = pool.arrays()
        new = [jax.device_put(x, a.sharding) for x, a in zip(new, arrays, strict=True)]
        slots = jax.device_put(slot, _replicated(arrays[0]))
        write = _slot_writer(pool.mesh, pool.state_axis, len(arrays))
        return pool._with_arrays(_write_slot(arrays, slots, tuple(new), pool._logical_dtypes(), write))


def _conv_to_storage(pool: Any, i: int, x: jax.Array) -> jax.Array:
    """``[layers, 1, *logical]`` -> conv tensor ``i``'s stored form (lane-dense: flat, padded)."""
    if pool.conv_shapes is None:
        return x
    rows, lanes = pool.conv[i].shape[2:]
    flat = jnp.asarray(x).reshape(x.shape[0], -1)
    flat = jnp.pad(flat, ((0, 0), (0, rows * lanes - flat.shape[1])))
    return flat.reshape(x.shape[0], 1, rows, lanes)


def _conv_from_storage(pool: Any, i: int, x: jax.Array) -> jax.Array:
    if pool.conv_shapes is None:
        return x
    shape = pool.conv_shapes[i]
    return x.reshape(x.shape[0], -1)[:, : math.prod(shape)].reshape(x.shape[0], 1, *shape)


@functools.partial(jax.jit, static_argnums=(2,))
def _read_slot(arrays: tuple[jax.Array, ...], slot: jax.Array, logical: tuple[Any, ...]) -> tuple[jax.Array, ...]:
    """Every layer's state of ``slot`` (``[1]``), ``[layers, 1, *stored]`` per tensor, logical dtype."""
    loc = route_to_trash(slot, arrays[0].shape[1])
    return tuple(dtypes.from_storage(a[:, loc], dt) for a, dt in zip(arrays, logical, strict=True))


def _write_one(arrays: tuple[jax.Array, ...], slot: jax.Array, new: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    loc = route_to_trash(slot, arrays[0].shape[1])
    return tuple(a.at[:, loc].set(x) for a, x in zip(arrays, new, strict=True))


@functools.cache
def _slot_writer(mesh: Any, axis: str | tuple[str, ...] | None, count: int) -> Any:
    """``write(arrays, slot, new)``: per device under ``shard_map`` over a sharded pool."""
    if mesh is None:
        return _write_one
    specs = tuple(_STATE_SPEC(axis) for _ in range(count))
    return jax.shard_map(_write_one, mesh=mesh, in_specs=(specs, P(), specs), out_specs=specs)


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=(0,))
def _write_slot(
    arrays: tuple[jax.Array, ...], slot: jax.Array, new: tuple[jax.Array, ...], logical: tuple[Any, ...], write: Any
) -> tuple[jax.Array, ...]:
    """``arrays`` with ``new`` (``[layers, 1, *stored]`` each, cast to the logical dtype, stored as
    the storage dtype) in slot ``slot`` of every layer; the arrays are donated (in place)."""
    stored = tuple(
        dtypes.to_storage(jnp.asarray(x).astype(dt), a.dtype) for a, x, dt in zip(arrays, new, logical, strict=True)
    )
    return write(arrays, slot, stored)


def piece_bytes(specs: Sequence[PieceSpec]) -> int:
    """Bytes of ``specs`` together."""
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in specs)
