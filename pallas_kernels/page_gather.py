"""Page gather / scatter: pack pages of every layer into one contiguous buffer and back.

The device half of host offload (HiCache write-back / load-back) and of the retraction backup.
Layers are ``[pages + 1, page_size, 2 * kv_heads, head_dim_padded]`` arrays of one shape and
dtype; page 0 is the trash page.

Buffer layout (layer-first): ``buffer[l, i] == layers[l][pages[i]]``, shape
``[num_layers, n, page_size, 2 * kv_heads, head_dim_padded]``, the pool's dtype (bytes are
moved, never converted).

Semantics (kernel and reference agree):

* gather: page ids out of range read the trash page (garbage, never another live page).
* scatter: destinations on the trash page or out of range are dropped; the rest must be unique
  (a caller error otherwise; the TPU interpreter's race detector reports it).

Kernel design: the wrapper groups ids into runs of consecutive pages; the kernel issues one
HBM->HBM DMA per run per layer (``layers[l][p:p+k] <-> buffer[l, i:i+k]``): offloading the
pages of one sequence, allocated in order, is a handful of DMAs per layer. Scatter aliases the
layers to its outputs (in place under donation); gather writes a fresh buffer.

Host memory: ``gather_pages_to_host`` places the buffer in ``pinned_host`` memory where the
backend has that memory kind (TPU and CPU in this jax), else returns a numpy copy; the
device-to-host hop is XLA's transfer after the gather, not a DMA of the kernel into host
memory.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _engine
from pallas_kernels._engine import Interpret

Layers = tuple[jax.Array, ...]
_WHAT_LAYERS = "per-layer [pages + 1, page_size, 2 * kv_heads, head_dim_padded] arrays"
PINNED_HOST = "pinned_host"


def _src_pages(pages: jax.Array, num_pages: int) -> jax.Array:
    return jnp.where((pages >= 0) & (pages < num_pages), pages, 0)


def _dst_pages(pages: jax.Array, num_pages: int) -> jax.Array:
    return jnp.where((pages >= 1) & (pages < num_pages), pages, -1)


def gather_pages_reference(layers: Layers, pages: jax.Array) -> jax.Array:
    """Pure-jnp gather: ``[L, n, page_size, C, D]`` with ``out[l, i] = layers[l][pages[i]]``."""
    src = _src_pages(pages, layers[0].shape[0])
    return jnp.stack([layer[src] for layer in layers])


def scatter_pages_reference(layers: Layers, buffer: jax.Array, pages: jax.Array) -> Layers:
    """Pure-jnp scatter: ``layers[l][pages[i]] = buffer[l, i]`` for kept pages; in place under donation."""
    num_pages = layers[0].shape[0]
    dst = _dst_pages(pages, num_pages)
    dst = jnp.where(dst < 0, num_pages, dst)  # out of bounds: mode="drop" discards it
    return tuple(layer.at[dst].set(buffer[i], mode="drop") for i, layer in enumerate(layers))


def _runs_kernel(
    starts_ref: Any,
    num_runs_ref: Any,
    src_ref: Any,
    dst_ref: Any,
    *refs: Any,
    num_layers: int,
    gather: bool,
    dynamic: bool,
) -> None:
    """Gather: refs = L layers, buffer out, sem. Scatter: refs = buffer, L layers in, L layers out, sem."""
    if gather:
        layers, buffer = refs[:num_layers], refs[num_layers]
    else:
        buffer, layers = refs[0], refs[1 + num_layers : 1 + 2 * num_layers]
    sem = refs[-1]

    for layer_index, layer in enumerate(layers):

        def issue(r: Any, action: str, layer: Any = layer, layer_index: int = layer_index) -> None:
            start = starts_ref[r]
            length = starts_ref[r + 1] - start
            page = src_ref[start] if gather else dst_ref[start]

            @pl.when(page >= 0)
            def _() -> None:
                def make(o: Any, size: Any) -> Any:
                    in_pool = layer.at[pl.ds(page + o, size)]
                    in_buffer = buffer.at[layer_index, pl.ds(start + o, size)]
                    if gather:
                        return pltpu.make_async_copy(in_pool, in_buffer, sem.at[0])
                    return pltpu.make_async_copy(in_buffer, in_pool, sem.at[0])

                _engine.copy_run(make, length, dynamic=dynamic, action=action)

        _engine.for_each_run(num_runs_ref[0], issue)


def _runs_call(
    layers: Layers, pages: jax.Array, *, gather: bool, interpret: Interpret
) -> tuple[tuple[jax.Array, ...], Any]:
    """``(scalars, kernel)`` of a gather (pool pages -> buffer rows) or a scatter (buffer rows ->
    pool pages): the run tables ``(starts, num_runs, src ids, dst ids)`` over elements ``i`` of
    ``pages`` (buffer row ``i``; pool ids past the pool are clamped or dropped as in the
    references) and ``_runs_kernel`` set for the direction."""
    num_pages = layers[0].shape[0]
    in_pool = _src_pages(pages, num_pages) if gather else _dst_pages(pages, num_pages)
    index = jnp.arange(pages.shape[0], dtype=jnp.int32)
    src, dst = (in_pool, index) if gather else (index, in_pool)
    starts, num_runs = _engine.contiguous_runs(src, dst)
    kernel = functools.partial(
        _runs_kernel, num_layers=len(layers), gather=gather, dynamic=_engine.uses_dynamic_dma(interpret)
    )
    return (starts, num_runs, src, dst), kernel


def gather_pages_kernel(layers: Layers, pages: jax.Array, *, interpret: Interpret = False) -> jax.Array:
    """The Pallas gather (compiled when ``interpret`` is False; TPU only)."""
    scalars, kernel = _runs_call(layers, pages, gather=True, interpret=interpret)
    out_shape = (len(layers), pages.shape[0], *layers[0].shape[1:])
    return _engine.dma_call(
        kernel,
        scalars,
        layers,
        out_shape=_engine.out_like(layers[0], out_shape),
        bytes_accessed=2 * math.prod(out_shape) * layers[0].dtype.itemsize,
        interpret=interpret,
        name="gather_pages",
    )


def scatter_pages_kernel(
    layers: Layers, buffer: jax.Array, pages: jax.Array, *, interpret: Interpret = False
) -> Layers:
    """The Pallas scatter (compiled when ``interpret`` is False; TPU only)."""
    scalars, kernel = _runs_call(layers, pages, gather=False, interpret=interpret)
    outs = _engine.dma_call(
        kernel,
        scalars,
        (buffer, *layers),
        out_shape=[_engine.out_like(x) for x in layers],
        aliases={1 + i: i for i in range(len(layers))},  # inputs: buffer, then the layers
        bytes_accessed=2 * buffer.size * buffer.dtype.itemsize,
        interpret=interpret,
        name="scatter_pages",
    )
    return tuple(outs)


def gather_pages(layers: Layers, pages: jax.Array, *, interpret: Interpret = None) -> jax.Array:
    """Pack ``pages`` of every layer into ``[num_layers, n, page_size, C, D]`` (see module docstring).

    Args:
      layers: tuple of ``[pages + 1, page_size, 2 * kv_heads, head_dim_padded]`` arrays.
      pages: integer ``[n]`` page ids.
      interpret: as for ``write_kv``.
    """
    _engine.check_layers("layers", layers, 4, _WHAT_LAYERS)
    pages = _engine.as_ids("pages", pages)
    if pages.shape[0] == 0:
        return jnp.zeros((len(layers), 0, *layers[0].shape[1:]), layers[0].dtype)
    return _engine.dispatch(gather_pages_kernel, gather_pages_reference, tuple(layers), pages, interpret=interpret)


def scatter_pages(layers: Layers, buffer: jax.Array, pages: jax.Array, *, interpret: Interpret = None) -> Layers:
    """Unpack ``buffer`` (from ``gather_pages``) into ``pages`` of every layer; return the new layers.

    ``buffer``: ``[num_layers, n, page_size, C, D]`` of the layers' dtype; ``pages``: integer
    ``[n]``. Donate ``layers`` under ``jit`` for an in-place write.
    """
    shape, dtype = _engine.check_layers("layers", layers, 4, _WHAT_LAYERS)
    pages = _engine.as_ids("pages", pages)
    want = (len(layers), pages.shape[0], *shape[1:])
    what = "[num_layers, n_pages, page_size, 2 * kv_heads, head_dim_padded]"
    _engine.check_array("buffer", buffer, want, dtype, what=what)
    if pages.shape[0] == 0:
        return tuple(layers)
    return _engine.dispatch(
        scatter_pages_kernel, scatter_pages_reference, tuple(layers), buffer, pages, interpret=interpret
    )


def has_memory_kind(device: jax.Device, kind: str = PINNED_HOST) -> bool:
    """Whether ``device`` can address memory of ``kind`` (e.g. ``"pinned_host"``)."""
    try:
        return any(m.kind == kind for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


def gather_pages_to_host(layers: Layers, pages: Any, *, interpret: Interpret = None) -> jax.Array | np.ndarray:
    """Gather ``pages`` of every layer into host memory (eager; not for use under ``jit``).

    Returns a ``jax.Array`` in ``pinned_host`` memory when the layers' devices have that memory
    kind, else a numpy array. Either way ``scatter_pages_from_host`` takes it back.
    """
    sharding = layers[0].sharding
    if all(has_memory_kind(d) for d in sharding.device_set):
        host = _buffer_sharding(sharding).with_memory_kind(PINNED_HOST)
        return jax.jit(functools.partial(gather_pages, interpret=interpret), out_shardings=host)(
            tuple(layers), jnp.asarray(pages, jnp.int32)
        )
    return np.asarray(jax.device_get(gather_pages(layers, jnp.asarray(pages, jnp.int32), interpret=interpret)))


def _buffer_sharding(layer_sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The buffer's sharding for a layer sharding: the layer axes shift right by the new layer axis."""
    if isinstance(layer_sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(None, *layer_sharding.spec)
        return jax.sharding.NamedSharding(layer_sharding.mesh, spec, memory_kind=layer_sharding.memory_kind)
    return layer_sharding


@functools.partial(jax.jit, static_argnames="interpret", donate_argnums=0)
def _scatter_donated(layers: Layers, buffer: jax.Array, pages: jax.Array, interpret: Interpret) -> Layers:
    return scatter_pages(layers, buffer, pages, interpret=interpret)


def scatter_pages_from_host(
    layers: Layers, buffer: jax.Array | np.ndarray, pages: Any, *, interpret: Interpret = None
) -> Layers:
    """Load a host buffer from ``gather_pages_to_host`` back into ``pages``; ``layers`` are donated.

    The buffer is first copied to the layers' device memory (one transfer of the buffer's
    bytes), then scattered in place.
    """
    target = _buffer_sharding(layers[0].sharding)
    memory_kind = layers[0].sharding.memory_kind
    device_buffer = jax.device_put(buffer, target if memory_kind is None else target.with_memory_kind(memory_kind))
    return _scatter_donated(tuple(layers), device_buffer, jnp.asarray(pages, jnp.int32), interpret)
