"""Page copy: copy token slots or whole pages ``src[i] -> dst[i]`` in every layer of a pool.

Used for SGLang's ``move_kv_cache``, copy-on-write of a shared last page and defragmentation.
Layers are ``[pages + 1, page_size, 2 * kv_heads, head_dim_padded]`` arrays of one shape and
dtype; page 0 is the trash page.

Semantics (kernel and reference agree):

* Snapshot: every source is read before any destination is written, so for a chain
  ``1 -> 2, 2 -> 3`` element 3 receives the *old* content of 2, and a swap ``1 -> 2, 2 -> 1``
  swaps.
* Destinations on the trash page or out of range are dropped (never written). Sources out of
  range read the trash page (garbage, but never another live slot).
* Destinations must be unique among the kept copies (a caller error otherwise: undefined which
  copy wins; the TPU interpreter's race detector reports it).

Kernel design: the wrapper groups copies into runs where source and destination ids both grow
by one (for slots: within one page) and decides, with jnp, whether any kept destination is
also a source. If none is (the usual case: copy-on-write, moves into free pages), each run is
one HBM->HBM DMA per layer. Otherwise the kernel goes through a staging buffer of the copied
elements: all runs source -> staging, wait, then staging -> destination (two DMAs per run per
layer), layer by layer. The staging buffer is a temporary of ``n`` elements (one layer), not of
the pool. Layers are aliased to the outputs: in place under donation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _engine
from pallas_kernels._engine import Interpret

Layers = tuple[jax.Array, ...]
_WHAT_LAYERS = "per-layer [pages + 1, page_size, 2 * kv_heads, head_dim_padded] arrays"


def _route(src: jax.Array, dst: jax.Array, num_units: int, first_live: int) -> tuple[jax.Array, jax.Array]:
    """Sources out of range -> 0 (trash); destinations not live -> -1 (dropped)."""
    src = jnp.where((src >= 0) & (src < num_units), src, 0)
    dst = jnp.where((dst >= first_live) & (dst < num_units), dst, -1)
    return src, dst


def _reference(layers: Layers, src: jax.Array, dst: jax.Array, *, unit: str) -> Layers:
    """Snapshot copy in jnp: gather all sources, then scatter them to the kept destinations."""
    out = []
    for layer in layers:
        pages, page_size, heads, dim = layer.shape
        flat = layer.reshape(pages * page_size, heads, dim) if unit == "slot" else layer
        num_units = flat.shape[0]
        s, d = _route(src, dst, num_units, page_size if unit == "slot" else 1)
        rows = flat[s]
        flat = flat.at[jnp.where(d < 0, num_units, d)].set(rows, mode="drop")
        out.append(flat.reshape(layer.shape))
    return tuple(out)


def copy_slots_reference(layers: Layers, src: jax.Array, dst: jax.Array) -> Layers:
    """Pure-jnp slot copy (the spec and the non-TPU path); ids are token slot ids."""
    return _reference(layers, src, dst, unit="slot")


def copy_pages_reference(layers: Layers, src: jax.Array, dst: jax.Array) -> Layers:
    """Pure-jnp page copy (the spec and the non-TPU path); ids are page ids."""
    return _reference(layers, src, dst, unit="page")


def _copy_kernel(
    starts_ref: Any,
    num_runs_ref: Any,
    src_ref: Any,
    dst_ref: Any,
    overlap_ref: Any,
    *refs: Any,
    num_layers: int,
    unit_view: Callable[[Any, Any, Any, Any], Any],
    dynamic: bool,
) -> None:
    # refs: L inputs (aliased, unused), L outputs, staging output, DMA semaphore.
    layers = refs[num_layers : 2 * num_layers]
    staging, sem = refs[2 * num_layers], refs[2 * num_layers + 1]

    def runs(src_of: Callable[[Any, Any, Any], Any], dst_of: Callable[[Any, Any, Any], Any]) -> None:
        def issue(r: Any, action: str) -> None:
            start = starts_ref[r]
            length = starts_ref[r + 1] - start

            @pl.when(dst_ref[start] >= 0)
            def _() -> None:
                def make(o: Any, size: Any) -> Any:
                    return pltpu.make_async_copy(src_of(start, o, size), dst_of(start, o, size), sem.at[0])

                _engine.copy_run(make, length, dynamic=dynamic, action=action)

        _engine.for_each_run(num_runs_ref[0], issue)

    def staged(start: Any, o: Any, size: Any) -> Any:
        return staging.at[pl.ds(start + o, size)]

    for layer in layers:
        src_of = _indexed(unit_view, layer, src_ref)
        dst_of = _indexed(unit_view, layer, dst_ref)

        @pl.when(overlap_ref[0] == 0)
        def _(src_of: Any = src_of, dst_of: Any = dst_of) -> None:
            runs(src_of, dst_of)

        @pl.when(overlap_ref[0] != 0)
        def _(src_of: Any = src_of, dst_of: Any = dst_of) -> None:
            runs(src_of, staged)  # every read of this layer completes here ...
            runs(staged, dst_of)  # ... before the first write


def _indexed(unit_view: Callable[[Any, Any, Any, Any], Any], ref: Any, ids_ref: Any) -> Callable[[Any, Any, Any], Any]:
    """(element index, offset, size) -> the slice of ``ref`` holding ids ``ids_ref[index] + offset ...``."""

    def view(start: Any, o: Any, size: Any) -> Any:
        return unit_view(ref, ids_ref[start], o, size)

    return view


def _slot_view(page_size: int) -> Callable[[Any, Any, Any, Any], Any]:
    def view(ref: Any, slot: Any, o: Any, size: Any) -> Any:
        page = jax.lax.div(slot, page_size)  # slot >= 0
        return ref.at[page, pl.ds(slot - page * page_size + o, size)]

    return view


def _page_view(ref: Any, page: Any, o: Any, size: Any) -> Any:
    return ref.at[pl.ds(page + o, size)]


def _dst_overlaps_src(src: jax.Array, dst: jax.Array) -> jax.Array:
    """int32 ``[1]``: 1 if a kept destination id is also a source id (O(n log n))."""
    ordered = jnp.sort(src)
    pos = jnp.clip(jnp.searchsorted(ordered, dst), 0, src.shape[0] - 1)
    return jnp.any((ordered[pos] == dst) & (dst >= 0)).astype(jnp.int32).reshape(1)


def _copy_pallas(layers: Layers, src: jax.Array, dst: jax.Array, *, unit: str, interpret: Interpret) -> Layers:
    pages, page_size, heads, dim = layers[0].shape
    n = src.shape[0]
    dtype = layers[0].dtype
    if unit == "slot":
        src, dst = _route(src, dst, pages * page_size, page_size)
        starts, num_runs = _engine.contiguous_runs(src, dst, src_group=page_size, dst_group=page_size)
        view = _slot_view(page_size)
        staging_shape: tuple[int, ...] = (n, heads, dim)
    else:
        src, dst = _route(src, dst, pages, 1)
        starts, num_runs = _engine.contiguous_runs(src, dst)
        view, staging_shape = _page_view, (n, page_size, heads, dim)
    overlap = _dst_overlaps_src(src, dst)
    num_layers = len(layers)
    kernel = functools.partial(
        _copy_kernel,
        num_layers=num_layers,
        unit_view=view,
        dynamic=_engine.uses_dynamic_dma(interpret),
    )
    outs = _engine.dma_call(
        kernel,
        (starts, num_runs, src, dst, overlap),
        layers,
        out_shape=[_engine.out_like(x) for x in layers] + [_engine.out_like(layers[0], staging_shape)],
        aliases={i: i for i in range(num_layers)},
        # Direct path: read and write each copied element once per layer (the staged path doubles it).
        bytes_accessed=2 * num_layers * math.prod(staging_shape) * dtype.itemsize,
        interpret=interpret,
        name=f"copy_{unit}s",
    )
    return tuple(outs[:num_layers])


def copy_slots_kernel(layers: Layers, src: jax.Array, dst: jax.Array, *, interpret: Interpret = False) -> Layers:
    """The Pallas slot copy (compiled when ``interpret`` is False; TPU only)."""
    return _copy_pallas(layers, src, dst, unit="slot", interpret=interpret)


def copy_pages_kernel(layers: Layers, src: jax.Array, dst: jax.Array, *, interpret: Interpret = False) -> Layers:
    """The Pallas page copy (compiled when ``interpret`` is False; TPU only)."""
    return _copy_pallas(layers, src, dst, unit="page", interpret=interpret)


def _checked(layers: Any, src: Any, dst: Any, kind: str) -> tuple[Layers, jax.Array, jax.Array]:
    _engine.check_layers("layers", layers, 4, _WHAT_LAYERS)
    src = _engine.as_ids("src", src)
    dst = _engine.as_ids("dst", dst)
    if src.shape != dst.shape:
        raise ValueError(f"dst has shape {list(dst.shape)}; expected {list(src.shape)} (one {kind} id per src id)")
    return tuple(layers), src, dst


def copy_slots(layers: Layers, src: jax.Array, dst: jax.Array, *, interpret: Interpret = None) -> Layers:
    """Copy token slot ``src[i]`` to slot ``dst[i]`` in every layer (snapshot semantics).

    Args:
      layers: tuple of ``[pages + 1, page_size, 2 * kv_heads, head_dim_padded]`` arrays, one
        shape and dtype. Donate them under ``jit`` for an in-place copy.
      src, dst: integer ``[n]`` slot ids (``page * page_size + offset``).
      interpret: as for ``write_kv``.

    Returns the new layers. See the module docstring for dropped ids and overlaps.
    """
    layers, src, dst = _checked(layers, src, dst, "slot")
    if src.shape[0] == 0:
        return layers
    return _engine.dispatch(copy_slots_kernel, copy_slots_reference, layers, src, dst, interpret=interpret)


def copy_pages(layers: Layers, src: jax.Array, dst: jax.Array, *, interpret: Interpret = None) -> Layers:
    """Copy page ``src[i]`` to page ``dst[i]`` in every layer (snapshot semantics).

    Like ``copy_slots`` with page ids; consecutive pages copy as one DMA per layer.
    """
    layers, src, dst = _checked(layers, src, dst, "page")
    if src.shape[0] == 0:
        return layers
    return _engine.dispatch(copy_pages_kernel, copy_pages_reference, layers, src, dst, interpret=interpret)
