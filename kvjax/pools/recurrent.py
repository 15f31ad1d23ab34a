"""`RecurrentStatePool`: the per-request recurrent state of hybrid SSM / linear-attention models
(SGLang's ``MambaPool`` state), as an immutable pytree.

Layout (the shapes are planned once, in ``kvjax.layout.recurrent``), one array per tensor
kind over all recurrent layers of the stage::

    conv[i] : [num_layers, num_slots + 1, *conv_state_shapes[i]]   (conv dtype, storage form)
    ssm     : [num_layers, num_slots + 1, *ssm_state_shape]         (SSM dtype, storage form)

* Slot 0 is the padding slot: padded batch rows read and write it; the allocator
  (``kvjax.alloc.state_slots.StateSlotAllocator``) never hands it out. Slot ``s`` of a request
  holds its state after its last processed token; a tree checkpoint is a slot too.
* Each tensor keeps its own dtype (SGLang: conv in the model dtype, SSM in ``mamba_ssm_dtype``,
  float32 by default). On CPU, 16-bit floats are stored as their uint16 bit pattern
  (``kvjax.pools.dtypes``: XLA:CPU updates bf16 buffers in O(buffer)); reads bit-cast back.

Every update returns a new pool; under ``jax.jit`` with the pool donated it is in place (its cost
grows with the slots written, never with the pool: ``benchmarks/recurrent_state.py`` measures it):
``zero_slots`` and ``fork`` run the ``pallas_kernels.state_slots`` kernels (Pallas on TPU, the jnp
reference elsewhere), ``set_states`` scatters one layer's new states.

Bounds: concrete slot ids are checked on the host (``InvalidSlotError`` naming them). Inside a
trace they cannot be; there, an id outside ``[0, num_slots]`` is routed to slot 0 (writes) or
dropped (zero, fork destinations), never clamped onto a live slot. Liveness (forking from or into
a free slot) is the allocator's to check: :func:`fork_live_slots`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.errors import InvalidSlotError
from kvjax.layout.build_context import BuildContext
from kvjax.layout.pool_plan import PoolPlan
from kvjax.layout.recurrent import RecurrentLayout
from kvjax.mesh_check import DCP_AXIS
from kvjax.pools import dtypes
from kvjax.pools.base import LayerStack, Pool, check_slots, is_traced, route_to_trash, static_field
from kvjax.pools.planned import planned_layout
from pallas_kernels import validate
from pallas_kernels.state_slots import copy_state_slots, zero_slots

__all__ = [
    "RecurrentStatePool",
    "apply_state_copies",
    "create_pool_group",
    "fork_live_slots",
    "independent_copy_groups",
    "state_axis_size",
]


class RecurrentStatePool(LayerStack, Pool):
    """Conv and SSM/delta-rule state of every recurrent layer of one stage (see module docstring).

    Data fields (pytree leaves): ``conv`` (one array per conv tensor) and ``ssm``. Meta fields
    (static under ``jit``): ``layer_ids`` (global ids of the recurrent layers, in array order),
    ``conv_dtype`` and ``ssm_dtype`` (logical kvjax dtype names).
    """

    LAYER_KIND = "recurrent"

    conv: tuple[jax.Array, ...]
    ssm: jax.Array
    layer_ids: tuple[int, ...] = static_field()
    conv_dtype: str = static_field()
    ssm_dtype: str = static_field()
    mesh: Mesh | None = static_field(default=None)  # set when the state is sharded over TP ranks
    # The mesh axis (or axes, jointly, major first) the heads are split over: "tp", or ("tp", "dcp")
    # under decode context parallelism (the whole TP group, as the weights; ``create_pool_group``).
    state_axis: str | tuple[str, ...] | None = static_field(default=None)
    # Lane-dense conv storage (TPU): the logical conv shapes, each stored flat as [rows, 128].
    conv_shapes: tuple[tuple[int, ...], ...] | None = static_field(default=None)

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        num_slots: int,
        layer_ids: tuple[int, ...] | list[int],
        conv_state_shapes: tuple[tuple[int, ...], ...] | list[tuple[int, ...]],
        ssm_state_shape: tuple[int, ...],
        conv_dtype: str = "bfloat16",
        ssm_dtype: str = "float32",
        platform: str = "cpu",
        mesh: Mesh | None = None,
        state_axis: str | tuple[str, ...] = "tp",
        lane_dense: bool | None = None,
    ) -> RecurrentStatePool:
        """A zeroed pool of ``num_slots`` allocatable slots (plus the padding slot 0) per layer.

        With a ``mesh``, the shapes are one rank's (``RecurrentStateSpec.per_rank``) and the state
        is sharded as SGLang shards it: the channel axis of each conv tensor and the head axis of
        the SSM tensor over ``state_axis`` (each device holds its rank's part, whole slots; a tuple
        of axes splits over them jointly, major first); zero and fork then run per device under
        ``shard_map``.

        ``lane_dense`` (default: on TPU) stores each conv tensor's state flat as ``[rows, 128]``
        (``rows = ceil(size / 128)``, zero-padded): a ``[channels, kernel - 1]`` window's last two
        axes are not tile-aligned, and XLA then copies the whole array around every in-place
        update (measured, deviceless v5e compile of a donated fork, Qwen3-Next at TP 8, 257 slots:
        2,313 MiB of temporaries with ``[1024, 3]``, none with ``[24, 128]``). Reads and writes
        take and give the logical shapes.
        """
        if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots < 0:
            raise InvalidSlotError(f"RecurrentStatePool: num_slots must be a non-negative integer, got {num_slots!r}")
        ids = tuple(int(i) for i in layer_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"RecurrentStatePool: layer_ids must be distinct and non-empty, got {list(ids)}")
        rows = int(num_slots) + 1

        ranks = 1 if mesh is None else state_axis_size(mesh, state_axis)
        sharding = None if mesh is None else NamedSharding(mesh, _STATE_SPEC(state_axis))

        def zeros(shape: tuple[int, ...], name: str) -> jax.Array:
            store = dtypes.storage_dtype(name, platform)
            full = (len(ids), rows, shape[0] * ranks, *shape[1:])
            return jax.jit(lambda: jnp.zeros(full, store), out_shardings=sharding)()

        dense = platform == "tpu" if lane_dense is None else bool(lane_dense)
        logical = tuple((s[0] * ranks, *s[1:]) for s in (tuple(x) for x in conv_state_shapes))
        stored = []
        for s in (tuple(x) for x in conv_state_shapes):
            if not dense:
                stored.append(s)
                continue
            size = math.prod(s)
            if ranks > 1 and size % _LANES:
                raise NotImplementedError(
                    f"a lane-dense conv state of {s} per rank ({size} elements, not a multiple of {_LANES}) "
                    "sharded over ranks is not built yet; build with lane_dense=False"
                )
            stored.append((-(-size // _LANES), _LANES))
        conv = tuple(zeros(s, conv_dtype) for s in stored)
        ssm = zeros(tuple(ssm_state_shape), ssm_dtype)
        return cls(
            conv=conv,
            ssm=ssm,
            layer_ids=ids,
            conv_dtype=conv_dtype,
            ssm_dtype=ssm_dtype,
            mesh=mesh,
            state_axis=state_axis if mesh is not None else None,
            conv_shapes=logical if dense else None,
        )

    # --- static facts ---------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_slots(self) -> int:
        """Allocatable slots (the padding slot excluded): valid ids are ``[0, num_slots]``."""
        return self.ssm.shape[1] - 1

    @property
    def conv_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The logical conv shapes (what reads give and writes take)."""
        if self.conv_shapes is not None:
            return self.conv_shapes
        return tuple(tuple(a.shape[2:]) for a in self.conv)

    def _conv_to_storage(self, i: int, x: jax.Array) -> jax.Array:
        """``[n, *logical]`` -> the stored form of conv tensor ``i`` (lane-dense: flat, padded)."""
        if self.conv_shapes is None:
            return x
        rows, lanes = self.conv[i].shape[2:]
        flat = jnp.asarray(x).reshape(x.shape[0], -1)
        flat = jnp.pad(flat, ((0, 0), (0, rows * lanes - flat.shape[1])))
        return flat.reshape(x.shape[0], rows, lanes)

    def _conv_from_storage(self, i: int, x: jax.Array) -> jax.Array:
        if self.conv_shapes is None:
            return x
        shape = self.conv_shapes[i]
        return x.reshape(x.shape[0], -1)[:, : math.prod(shape)].reshape(x.shape[0], *shape)

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        return tuple(self.ssm.shape[2:])

    def bytes_per_slot(self) -> int:
        """Bytes of one slot across every layer and tensor (one request's state)."""
        return sum(math.prod(a.shape[2:]) * a.dtype.itemsize for a in self.arrays()) * self.num_layers

    def nbytes(self) -> int:
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in self.arrays())

    def arrays(self) -> tuple[jax.Array, ...]:
        """Every state array, conv tensors first then the SSM tensor (the kernels' tuple)."""
        return (*self.conv, self.ssm)

    def _logical_dtypes(self) -> tuple[Any, ...]:
        """The logical dtype of each array of ``arrays()`` (what reads give, writes cast to)."""
        conv = dtypes.logical_dtype(self.conv_dtype)
        return (conv,) * len(self.conv) + (dtypes.logical_dtype(self.ssm_dtype),)

    def _with_arrays(self, arrays: tuple[jax.Array, ...]) -> RecurrentStatePool:
        return self.replace(conv=tuple(arrays[:-1]), ssm=arrays[-1])

    # --- updates --------------------------------------------------------------------------------

    def zero_slots(self, slots: Any) -> RecurrentStatePool:
        """Zero the state of ``slots`` (int ``[n]``, each in ``[1, num_slots]``) in every layer.

        Concrete ids outside ``[1, num_slots]`` raise ``InvalidSlotError`` (pool unchanged);
        traced ones out of range are dropped.
        """
        if not is_traced(slots):
            validate.check_ids_in_range("slots", slots, 1, self.num_slots + 1, kind="state slot")
        return self._with_arrays(self._per_device(zero_slots)(self.arrays(), jnp.asarray(slots, jnp.int32)))

    def fork(self, src: Any, dst: Any) -> RecurrentStatePool:
        """Copy-on-write fork: slot ``src[i]`` -> ``dst[i]`` in every layer of every tensor.

        Concrete ids are checked (``InvalidSlotError``, pool unchanged): all in
        ``[1, num_slots]``, destinations unique and none also a source. Whether the slots are
        live is the allocator's to say: see :func:`fork_live_slots`.
        """
        if not (is_traced(src) or is_traced(dst)):
            validate.check_fork(src, dst, self.num_slots + 1)
        copy = self._per_device(copy_state_slots)
        return self._with_arrays(copy(self.arrays(), jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)))

    def _per_device(self, op: Any) -> Any:
        """``op(arrays, *ids)``, per device under ``shard_map`` when the pool is sharded (a Mosaic
        kernel is not partitioned automatically); the ids are replicated. Over a mesh it is one
        compiled program per ``(op, mesh, layout, number of id arrays)``, the arrays donated (in
        place, O(slots)): an eager ``shard_map`` would be traced again at every call."""
        if self.mesh is None:
            return op
        specs = tuple(_STATE_SPEC(self.state_axis) for _ in self.arrays())
        return lambda arrays, *ids: _per_device_program(op, self.mesh, specs, len(ids))(arrays, *ids)

    def set_states(
        self, layer_id: int, slots: Any, conv: tuple[jax.Array, ...] | list[jax.Array], ssm: jax.Array
    ) -> RecurrentStatePool:
        """Write one layer's new states: ``conv[i][j]`` and ``ssm[j]`` into slot ``slots[j]``.

        ``conv[i]``: ``[n, *conv_state_shapes[i]]``, ``ssm``: ``[n, *ssm_state_shape]``, any
        float dtype (cast to the pool's). Padded rows may write slot 0. Concrete slots outside
        ``[0, num_slots]`` raise ``InvalidSlotError``; traced ones go to slot 0.
        """
        index = self.layer_index(layer_id)
        check_slots(slots, self.num_slots + 1, name="slots")
        if len(conv) != len(self.conv):
            raise ValueError(f"conv: {len(conv)} tensors given; this pool has {len(self.conv)}")
        n = int(np.shape(slots)[0])
        for i, (shape, x) in enumerate(zip(self.conv_state_shapes, conv, strict=True)):
            want = (n, *shape)
            if tuple(x.shape) != want:
                raise ValueError(f"conv[{i}] has shape {tuple(x.shape)}; expected {want}")
        conv = [self._conv_to_storage(i, x) for i, x in enumerate(conv)]
        want = (n, *self.ssm.shape[2:])
        if tuple(ssm.shape) != want:
            raise ValueError(f"ssm has shape {tuple(ssm.shape)}; expected {want}")
        arrays = _write_layer(self.arrays(), index, jnp.asarray(slots, jnp.int32), (*conv, ssm), self._logical_dtypes())
        return self._with_arrays(arrays)

    # --- reads ----------------------------------------------------------------------------------

    def get_states(self, layer_id: int, slots: Any) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """One layer's states of ``slots`` in the logical dtypes: ``(conv tensors, ssm)``.

        Concrete slots outside ``[0, num_slots]`` raise; traced ones read slot 0.
        """
        index = self.layer_index(layer_id)
        check_slots(slots, self.num_slots + 1, name="slots")
        out = _read_layer(self.arrays(), index, jnp.asarray(slots, jnp.int32), self._logical_dtypes())
        return tuple(self._conv_from_storage(i, x) for i, x in enumerate(out[:-1])), out[-1]


@functools.partial(jax.jit, static_argnums=(1, 4))
def _write_layer(
    arrays: tuple[jax.Array, ...], index: int, slots: jax.Array, new: tuple[jax.Array, ...], logical: tuple[Any, ...]
) -> tuple[jax.Array, ...]:
    """Scatter one layer's new states (cast to the logical dtype, stored as the storage dtype);
    slots outside ``[0, num_slots]`` go to the padding slot 0."""
    loc = route_to_trash(slots, arrays[0].shape[1])
    return tuple(
        a.at[index, loc].set(dtypes.to_storage(jnp.asarray(x).astype(dt), a.dtype))
        for a, x, dt in zip(arrays, new, logical, strict=True)
    )


@functools.partial(jax.jit, static_argnums=(1, 3))
def _read_layer(
    arrays: tuple[jax.Array, ...], index: int, slots: jax.Array, logical: tuple[Any, ...]
) -> tuple[jax.Array, ...]:
    """One layer's states of ``slots`` in their logical dtypes (out of range: slot 0)."""
    loc = route_to_trash(slots, arrays[0].shape[1])
    return tuple(dtypes.from_storage(a[index, loc], dt) for a, dt in zip(arrays, logical, strict=True))


def fork_live_slots(pool: RecurrentStatePool, allocator: Any, src: Any, dst: Any) -> RecurrentStatePool:
    """:meth:`RecurrentStatePool.fork` after asking ``allocator`` (the owner of slot liveness,
    a ``StateSlotAllocator``) that every source and destination is live.

    Raises ``InvalidSlotError`` naming the free slots (pool and allocator unchanged).
    """
    allocator.check_live(src, "fork src")
    allocator.check_live(dst, "fork dst")
    return pool.fork(src, dst)


def independent_copy_groups(copies: list[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``copies`` ``(src, dst)`` split, in order, into consecutive groups ``(srcs, dsts)`` (int32
    slot ids) whose copies can run at once: within a group no destination repeats and none is read
    or written by another copy of it, so applying the groups one after another equals the copies
    done one by one. ``src == dst`` is skipped."""
    groups: list[tuple[np.ndarray, np.ndarray]] = []
    srcs: list[int] = []
    dsts: list[int] = []
    for src, dst in copies:
        src, dst = int(src), int(dst)
        if src == dst:
            continue
        if dst in dsts or dst in srcs or src in dsts:
            groups.append((np.asarray(srcs, np.int32), np.asarray(dsts, np.int32)))
            srcs, dsts = [], []
        srcs.append(src)
        dsts.append(dst)
    if srcs:
        groups.append((np.asarray(srcs, np.int32), np.asarray(dsts, np.int32)))
    return groups


@functools.lru_cache(maxsize=64)
def _per_device_program(op: Any, mesh: Mesh, specs: tuple[P, ...], num_ids: int) -> Any:
    """``op(arrays, *ids)`` under ``shard_map`` over ``mesh`` (the arrays split as ``specs``, the
    ``num_ids`` id arrays replicated), jitted with the arrays donated."""

    def run(arrays: tuple[jax.Array, ...], *ids: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(op(arrays, *ids))

    mapped = jax.shard_map(run, mesh=mesh, in_specs=(specs, *(P() for _ in range(num_ids))), out_specs=specs)
    return jax.jit(mapped, donate_argnums=0)


def apply_state_copies(pool: RecurrentStatePool, copies: list[tuple[int, int]]) -> RecurrentStatePool:
    """Apply queued slot copies ``(src, dst)`` in order (a tree's ``take_state_copies``: forks of
    matched checkpoints into request slots, request states into new checkpoint slots), one
    :meth:`RecurrentStatePool.fork` per :func:`independent_copy_groups` group. Donate the pool for
    in-place copies.
    """
    for srcs, dsts in independent_copy_groups(copies):
        pool = pool.fork(srcs, dsts)
    return pool


_LANES = 128  # TPU lane width: the last axis of a lane-dense conv state


def state_axis_size(mesh: Mesh, axis: str | tuple[str, ...]) -> int:
    """The ranks the state's heads are split over: the size of ``axis`` on ``mesh`` (a tuple of
    axes: the product of their sizes)."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    return math.prod(int(mesh.shape[name]) for name in names)


def _STATE_SPEC(axis: str | tuple[str, ...] | None) -> P:  # noqa: N802 - reads as a constant spec
    """State arrays sharded over their channel / head axis (axis 2)."""
    return P(None, None, axis)


def create_pool_group(pools: tuple[PoolPlan, ...], context: BuildContext) -> RecurrentStatePool:
    """The pool kind registry's group builder for ``"recurrent"``: the plan lists one
    ``PoolPlan`` per tensor (``conv_state_<i>``, ``ssm_state``), all carrying the same
    ``RecurrentLayout``; they become one pool (forks and zeroing touch every tensor at once). With a
    mesh the state is sharded over its ``"tp"`` axis, which must have the layout's ``tp_size``;
    under decode context parallelism (``context.context_axis``) over ``("tp", "dcp")`` jointly,
    tp-major: the whole TP group, as the gated delta net's weights are split
    (``kvjax.serve.param_sharding``), so device ``(t, d)`` holds heads block ``t * dcp + d`` of every
    slot. The state is per request, not per token: it is not striped (``kvjax.plan.dcp``)."""
    layout = planned_layout(pools[0], "recurrent", RecurrentLayout)
    mesh = context.mesh
    axis: str | tuple[str, ...] = context.kv_head_axis
    if mesh is not None and DCP_AXIS in mesh.axis_names:  # the whole group, whether the KV is striped or not
        axis = (context.kv_head_axis, DCP_AXIS)
    if mesh is not None and state_axis_size(mesh, axis) != layout.tp_size:
        raise NotImplementedError(
            f"the recurrent state is planned for tp_size={layout.tp_size} ranks but the mesh's "
            f"{axis!r} axes have {state_axis_size(mesh, axis)} devices (attention data "
            "parallelism); a recurrent pool over such a mesh is not built yet"
        )
    return RecurrentStatePool.create(
        num_slots=pools[0].shape[1] - 1,
        layer_ids=pools[0].layer_ids,
        conv_state_shapes=layout.conv_state_shapes,
        ssm_state_shape=layout.ssm_state_shape,
        conv_dtype=layout.conv_dtype,
        ssm_dtype=layout.ssm_dtype,
        platform=context.platform,
        mesh=mesh,
        state_axis=axis,
    )
