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

* paged layers: ``[layers, tokens, C, D]`` in the storage dtype; for MHA ``C = 2 * kv_heads``
  with each distinct KV head once (a pool whose TP size exceeds the model's KV heads holds each
  head on several ranks: its copies are dropped on the way out and made again on the way in),
  and the fp8 scales ``[layers]`` f32;
* recurrent state: ``[layers, 1, *state]`` per tensor (conv tensors and the SSM state), the
  logical (unpacked) shapes.

Invariants: ``gather`` reads only the request's slots and ``scatter`` writes only them, each
O(tokens moved) (the pool is donated to the jitted write: in place, ``pallas_kernels.kv_write``);
pieces carry no page structure, so page sizes may differ between the sides; a pool whose token
rows are striped over a decode-context-parallel axis is refused (``NotImplementedError``).
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

from pallas_kernels.kv_write import write_kv

__all__ = [
    "PieceSpec",
    "PagedRequestKV",
    "RecurrentRequestKV",
    "RequestKV",
    "RequestSpan",
    "SWARequestKV",
    "head_shards",
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


def head_shards(mesh: Any, axis: str | None) -> int:
    """Devices a pool's head axis is split over (1 without a mesh)."""
    return 1 if mesh is None or axis is None else int(mesh.shape[axis])


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


def _row_writer(pool: Any) -> Any:
    """``write(layer, rows [n, C, D], slots) -> layer`` for one layer array of ``pool`` (per device
    under ``shard_map`` when the pool's heads are split over a mesh)."""
    mesh = getattr(pool, "mesh", None)
    axis = getattr(pool, "kv_head_axis", None)
    if mesh is None:
        return write_kv
    layer_spec = P(None, None, axis, None)
    return jax.shard_map(
        write_kv, mesh=mesh, in_specs=(layer_spec, P(None, axis, None), P()), out_specs=layer_spec, check_vma=False
    )


def _layer_sharding(pool: Any) -> Any:
    """Where the pieces of ``pool`` must lie before its write (the pool's devices)."""
    layer = pool.layer_arrays[0]
    mesh = getattr(pool, "mesh", None)
    if mesh is None:
        return SingleDeviceSharding(next(iter(layer.devices())))
    axis = getattr(pool, "kv_head_axis", None)
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
        c, d = layer.shape[2:]
        has_heads = getattr(pool, "num_kv_heads", None) is not None
        c //= _replicas(pool, kv_heads)
        n = span.window_tokens if self.window else span.tokens
        rows = PieceSpec(
            "rows", (len(pool.layer_arrays), n, c, d), str(layer.dtype), 2 if has_heads else None, 1, self.window
        )
        scales = tuple(PieceSpec(f, tuple(getattr(pool, f).shape), "float32") for f in self._scales(pool))
        return (rows, *scales)

    def gather(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[jax.Array, ...]:
        _refuse_striped(pool)
        rows = _gather_rows(tuple(pool.layer_arrays), jnp.asarray(self._slots(span)), _replicas(pool, kv_heads))
        # the scales are copied: the pool's own arrays are donated into the next step
        return (rows, *(jnp.copy(getattr(pool, f)) for f in self._scales(pool)))

    def scatter(self, pool: Any, pieces: Sequence[jax.Array], span: RequestSpan, kv_heads: int) -> Any:
        _refuse_striped(pool)
        rows, *scales = pieces
        rows = jax.device_put(rows, _layer_sharding(pool))
        slots = jax.device_put(self._slots(span), _replicated(rows))
        layers = _scatter_rows(tuple(pool.layer_arrays), rows, slots, _row_writer(pool), _replicas(pool, kv_heads))
        updates = {pool.LAYERS_FIELD: layers}
        for name, value in zip(self._scales(pool), scales, strict=True):
            old = getattr(pool, name)
            updates[name] = jax.device_put(value, old.sharding)
        return pool.replace(**updates)


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
    (``conv.<i>`` and ``ssm``), in the logical shapes."""

    def _names(self, pool: Any) -> list[str]:
        return [*(f"conv.{i}" for i in range(len(pool.conv))), "ssm"]

    def _slot(self, span: RequestSpan) -> int:
        if span.state_slot is None:
            raise ValueError("the request holds no recurrent-state slot to move")
        return int(span.state_slot)

    def _read(self, pool: Any, slot: int) -> list[jax.Array]:
        out = []
        for index, layer_id in enumerate(pool.layer_ids):
            conv, ssm = pool.get_states(layer_id, jnp.asarray([slot], jnp.int32))
            if index == 0:
                out = [[c] for c in conv] + [[ssm]]
            else:
                for acc, value in zip(out, (*conv, ssm), strict=True):
                    acc.append(value)
        return [jnp.stack(values) for values in out]

    def pieces(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[PieceSpec, ...]:
        arrays = jax.eval_shape(lambda p: self._read(p, 1), pool)
        return tuple(PieceSpec(n, tuple(a.shape), str(a.dtype)) for n, a in zip(self._names(pool), arrays, strict=True))

    def gather(self, pool: Any, span: RequestSpan, kv_heads: int) -> tuple[jax.Array, ...]:
        return tuple(self._read(pool, self._slot(span)))

    def scatter(self, pool: Any, pieces: Sequence[jax.Array], span: RequestSpan, kv_heads: int) -> Any:
        slot = jnp.asarray([self._slot(span)], jnp.int32)
        first = next(iter(pool.ssm.devices()))
        pieces = [jax.device_put(p, SingleDeviceSharding(first)) if pool.mesh is None else p for p in pieces]
        for index, layer_id in enumerate(pool.layer_ids):
            conv = tuple(p[index] for p in pieces[:-1])
            pool = pool.set_states(layer_id, slot, conv, pieces[-1][index])
        return pool


def piece_bytes(specs: Sequence[PieceSpec]) -> int:
    """Bytes of ``specs`` together."""
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in specs)
