"""Recurrent-state slot ops: zero a set of state slots; copy slot ``src -> dst`` (fork).

State arrays (Mamba conv / SSM state and the like) are ``[num_layers, num_slots + 1, *state]``,
one array per kind of state, passed as a tuple (their ``state`` shapes and dtypes may differ,
their first two axes may not). Slot 0 is reserved: it is never zeroed or written by these ops.

Semantics (kernel and reference agree):

* ``zero_slots``: every kept slot (``1 <= slot < num_slots + 1``) becomes all-zero bits in every
  layer of every array; other ids are dropped.
* ``copy_state_slots``: ``state[:, dst[i]] = state[:, src[i]]`` for kept destinations
  (``1 <= dst < num_slots + 1``); sources out of range read slot 0. Precondition (checked on
  the host by ``validate.check_fork``, not on the device): kept destinations are unique and
  none is also a source, as with a fork into freshly allocated slots. Under it the result is
  the snapshot copy the reference computes; without it the kernel's result is undefined (the
  TPU interpreter's race detector reports it).

Kernel design: zeroing fills a VMEM buffer of ``layers_per_dma`` layers of one slot with
zeros once, then issues one VMEM->HBM DMA per slot per chunk of layers per array. Copying
groups pairs whose ids both grow by one into runs and issues one HBM->HBM DMA per run per array
(``state[:, s:s+k] -> state[:, d:d+k]``, strided over layers). Arrays are aliased to the
outputs: in place under donation.

Layout on TPU: make the last two state axes tile-aligned (rows a multiple of 16, lanes a
multiple of 128), e.g. a conv state ``[kernel - 1, conv_dim] = [3, 8192]`` stored as
``[3 * 8192 / 128, 128] = [192, 128]``. Otherwise XLA gives the array a transposed on-device
layout while the kernel needs the row-major one, and copies the whole array around every call
(measured, deviceless compile: ``[4, 129, 8192, 3]`` bf16 -> 1 GiB of temporaries on v5e;
``[4, 129, 3, 8192]`` -> 34 MB on v5p; ``[4, 129, 192, 128]`` -> none on v4/v5e/v5p/v6e).
The TPU compile tests use the aligned shapes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _engine
from pallas_kernels._engine import Interpret

States = tuple[jax.Array, ...]

#: Bytes of the VMEM zero buffer per array; layers of one slot are zeroed in chunks that fit.
ZERO_BUFFER_BYTES = 1 << 20


def _check_states(states: Any) -> tuple[int, int]:
    """Validate the state tuple; return ``(num_layers, num_slots + 1)``."""
    what = "per-kind [num_layers, num_slots + 1, *state] arrays sharing the first two axes"
    if not isinstance(states, (tuple, list)) or not states:
        raise TypeError(f"states must be a non-empty tuple of arrays ({what}), got {type(states).__name__}")
    lead = tuple(states[0].shape[:2])
    for i, a in enumerate(states):
        if a.ndim < 2 or tuple(a.shape[:2]) != lead:
            raise ValueError(f"states[{i}] has shape {list(a.shape)}; expected [{lead[0]}, {lead[1]}, ...] ({what})")
    return lead


def _kept(slots: jax.Array, num_slots: int) -> jax.Array:
    return jnp.where((slots >= 1) & (slots < num_slots), slots, -1)


def zero_slots_reference(states: States, slots: jax.Array) -> States:
    """Pure-jnp zeroing of the kept slots; in place under donation."""
    num_slots = states[0].shape[1]
    dst = _kept(slots, num_slots)
    dst = jnp.where(dst < 0, num_slots, dst)  # out of bounds: mode="drop" discards it
    return tuple(a.at[:, dst].set(jnp.zeros((), a.dtype), mode="drop") for a in states)


def copy_state_slots_reference(states: States, src: jax.Array, dst: jax.Array) -> States:
    """Pure-jnp snapshot copy ``state[:, dst[i]] = state[:, src[i]]`` of the kept destinations."""
    num_slots = states[0].shape[1]
    s = jnp.where((src >= 0) & (src < num_slots), src, 0)
    d = _kept(dst, num_slots)
    d = jnp.where(d < 0, num_slots, d)
    return tuple(a.at[:, d].set(a[:, s], mode="drop") for a in states)


def _vmem_bytes_per_layer(shape: tuple[int, ...], dtype: jnp.dtype) -> int:
    """VMEM bytes of one layer of one slot: TPU tiles pad the last two axes (sublanes x 128 lanes)."""
    itemsize = jnp.dtype(dtype).itemsize
    if not shape:
        return 128 * itemsize
    sublanes = 8 * max(1, 4 // itemsize)
    lanes = -(-shape[-1] // 128) * 128
    rows = -(-shape[-2] // sublanes) * sublanes if len(shape) >= 2 else 1
    return math.prod(shape[:-2]) * rows * lanes * itemsize


def _layers_per_dma(a: jax.ShapeDtypeStruct | jax.Array) -> int:
    per_layer = _vmem_bytes_per_layer(tuple(a.shape[2:]), a.dtype)
    return max(1, min(a.shape[0], ZERO_BUFFER_BYTES // per_layer))


def _zero_kernel(slots_ref: Any, *refs: Any, num_arrays: int, chunks: tuple[int, ...]) -> None:
    # refs: arrays in (aliased, unused), arrays out, one zero buffer per array, DMA semaphore.
    outs = refs[num_arrays : 2 * num_arrays]
    zbufs = refs[2 * num_arrays : 3 * num_arrays]
    sem = refs[-1]
    n = slots_ref.shape[0]
    for zbuf in zbufs:
        zbuf[...] = jnp.zeros(zbuf.shape, zbuf.dtype)

    def issue(i: Any, action: str) -> None:
        slot = slots_ref[i]

        @pl.when(slot >= 0)
        def _() -> None:
            for out, zbuf, chunk in zip(outs, zbufs, chunks, strict=True):
                num_layers = out.shape[0]
                for lo in range(0, num_layers, chunk):
                    size = min(chunk, num_layers - lo)
                    src = zbuf if size == chunk else zbuf.at[pl.ds(0, size)]
                    copy = pltpu.make_async_copy(src, out.at[pl.ds(lo, size), slot], sem.at[0])
                    getattr(copy, action)()

    _engine.for_each_run(n, issue)


def zero_slots_kernel(states: States, slots: jax.Array, *, interpret: Interpret = False) -> States:
    """The Pallas slot zeroing (compiled when ``interpret`` is False; TPU only)."""
    num_arrays = len(states)
    dst = _kept(slots, states[0].shape[1])
    chunks = tuple(_layers_per_dma(a) for a in states)
    kernel = functools.partial(_zero_kernel, num_arrays=num_arrays, chunks=chunks)
    zero_bytes = sum(math.prod(a.shape[2:]) * a.dtype.itemsize for a in states) * slots.shape[0] * states[0].shape[0]
    outs = _engine.dma_call(
        kernel,
        (dst,),
        states,
        out_shape=[_engine.out_like(a) for a in states],
        aliases={i: i for i in range(num_arrays)},
        scratch_shapes=[pltpu.VMEM((c, *a.shape[2:]), a.dtype) for a, c in zip(states, chunks, strict=True)],
        bytes_accessed=zero_bytes,
        interpret=interpret,
        name="zero_state_slots",
    )
    return tuple(outs)


def _copy_kernel(
    starts_ref: Any,
    num_runs_ref: Any,
    src_ref: Any,
    dst_ref: Any,
    *refs: Any,
    num_arrays: int,
    dynamic: bool,
) -> None:
    outs = refs[num_arrays : 2 * num_arrays]
    sem = refs[-1]

    def issue(r: Any, action: str) -> None:
        start = starts_ref[r]
        length = starts_ref[r + 1] - start
        src, dst = src_ref[start], dst_ref[start]

        @pl.when(dst >= 0)
        def _() -> None:
            for out in outs:

                def make(o: Any, size: Any, out: Any = out) -> Any:
                    return pltpu.make_async_copy(
                        out.at[:, pl.ds(src + o, size)], out.at[:, pl.ds(dst + o, size)], sem.at[0]
                    )

                _engine.copy_run(make, length, dynamic=dynamic, action=action)

    _engine.for_each_run(num_runs_ref[0], issue)


def copy_state_slots_kernel(states: States, src: jax.Array, dst: jax.Array, *, interpret: Interpret = False) -> States:
    """The Pallas state-slot copy (compiled when ``interpret`` is False; TPU only)."""
    num_slots = states[0].shape[1]
    num_arrays = len(states)
    n = src.shape[0]
    s = jnp.where((src >= 0) & (src < num_slots), src, 0)
    d = _kept(dst, num_slots)
    starts, num_runs = _engine.contiguous_runs(s, d)
    kernel = functools.partial(_copy_kernel, num_arrays=num_arrays, dynamic=_engine.uses_dynamic_dma(interpret))
    moved = 2 * n * sum(a.size // num_slots * a.dtype.itemsize for a in states)
    outs = _engine.dma_call(
        kernel,
        (starts, num_runs, s, d),
        states,
        out_shape=[_engine.out_like(a) for a in states],
        aliases={i: i for i in range(num_arrays)},
        bytes_accessed=moved,
        interpret=interpret,
        name="copy_state_slots",
    )
    return tuple(outs)


def zero_slots(states: States, slots: jax.Array, *, interpret: Interpret = None) -> States:
    """Zero ``slots`` (integer ``[n]``) in every layer of every state array; return the new states.

    Donate ``states`` under ``jit`` for an in-place update. ``interpret`` as for ``write_kv``.
    """
    _check_states(states)
    slots = _engine.as_ids("slots", slots)
    if slots.shape[0] == 0:
        return tuple(states)
    return _engine.dispatch(zero_slots_kernel, zero_slots_reference, tuple(states), slots, interpret=interpret)


def copy_state_slots(states: States, src: jax.Array, dst: jax.Array, *, interpret: Interpret = None) -> States:
    """Fork: copy state slot ``src[i]`` to ``dst[i]`` in every layer of every array.

    ``src``, ``dst``: integer ``[n]``; see the module docstring for the precondition on ``dst``.
    """
    _check_states(states)
    src = _engine.as_ids("src", src)
    dst = _engine.as_ids("dst", dst)
    if src.shape != dst.shape:
        raise ValueError(f"dst has shape {list(dst.shape)}; expected {list(src.shape)} (one slot per src slot)")
    if src.shape[0] == 0:
        return tuple(states)
    return _engine.dispatch(
        copy_state_slots_kernel, copy_state_slots_reference, tuple(states), src, dst, interpret=interpret
    )
