"""KV write: scatter new tokens' combined K/V rows into their token slots of one paged layer.

Layout: ``cache[page, offset, c, d]`` with ``c`` the combined head index (``2h`` = K of KV head
``h``, ``2h + 1`` = V) and token slot ``loc = page * page_size + offset``. Page 0 is the trash
page.

Semantics (kernel and reference agree):

* ``new_kv[i]`` lands in slot ``loc[i]`` for every ``loc[i]`` in ``[page_size, num_slots)``.
* Writes aimed at the trash page (``0 <= loc < page_size``) or outside the pool (``loc < 0``,
  ``loc >= num_slots``, e.g. padded tokens) are dropped: they never reach a live slot, and the
  trash page is left untouched (its content is unspecified anyway).
* Two tokens aimed at the same live slot is a caller error (undefined which wins; the TPU
  interpreter's race detector reports it).

Kernel design: the wrapper groups tokens whose slots are consecutive within one page into
runs (jnp, fixed shapes) and passes the run table by scalar prefetch; the kernel issues one
HBM->HBM DMA per run (``new_kv[s:s+L] -> cache[page, off:off+L]``), at most
``RUNS_IN_FLIGHT`` outstanding, and skips dropped runs. A decode batch (one token per
sequence) is one DMA per token; a prefill chunk of ``T`` tokens is about ``T / page_size``
DMAs. The cache is aliased to the output, so under ``jit`` with the cache donated the write
is in place: its cost grows with the tokens written, never with the pool.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _engine
from pallas_kernels._engine import Interpret

_WHAT_CACHE = "[pages + 1, page_size, 2 * kv_heads, head_dim_padded]"


def _dst_slots(loc: jax.Array, num_slots: int, page_size: int) -> jax.Array:
    """``loc`` with every slot that must not be written (trash page, out of range) set to -1."""
    return jnp.where((loc >= page_size) & (loc < num_slots), loc, -1)


def write_kv_reference(cache: jax.Array, new_kv: jax.Array, loc: jax.Array) -> jax.Array:
    """Pure-jnp KV write (the spec and the non-TPU path); in place under donation.

    ``cache``: ``[P, ps, C, D]``; ``new_kv``: ``[n, C, D]`` (same dtype); ``loc``: int32 ``[n]``.
    """
    pages, page_size, heads, dim = cache.shape
    num_slots = pages * page_size
    dst = _dst_slots(loc, num_slots, page_size)
    # num_slots is out of bounds, so mode="drop" discards those rows.
    dst = jnp.where(dst < 0, num_slots, dst)
    flat = cache.reshape(num_slots, heads, dim)
    flat = flat.at[dst].set(new_kv, mode="drop")
    return flat.reshape(pages, page_size, heads, dim)


def _kv_write_kernel(
    starts_ref: Any,
    num_runs_ref: Any,
    dst_ref: Any,
    new_ref: Any,
    cache_in_ref: Any,
    cache_ref: Any,
    sem: Any,
    *,
    page_size: int,
    dynamic: bool,
) -> None:
    del cache_in_ref  # the same buffer as cache_ref (aliased)

    def issue(r: Any, action: str) -> None:
        start = starts_ref[r]
        length = starts_ref[r + 1] - start
        slot = dst_ref[start]

        @pl.when(slot >= 0)
        def _() -> None:
            page = jax.lax.div(slot, page_size)  # slot >= 0: truncation == floor
            offset = slot - page * page_size

            def make(o: Any, size: Any) -> Any:
                return pltpu.make_async_copy(
                    new_ref.at[pl.ds(start + o, size)],
                    cache_ref.at[page, pl.ds(offset + o, size)],
                    sem.at[0],
                )

            _engine.copy_run(make, length, dynamic=dynamic, action=action)

    _engine.for_each_run(num_runs_ref[0], issue)


def write_kv_kernel(cache: jax.Array, new_kv: jax.Array, loc: jax.Array, *, interpret: Interpret = False) -> jax.Array:
    """The Pallas KV write (compiled when ``interpret`` is False; TPU only)."""
    pages, page_size, _, _ = cache.shape
    n = new_kv.shape[0]
    dst = _dst_slots(loc, pages * page_size, page_size)
    starts, num_runs = _engine.contiguous_runs(jnp.arange(n, dtype=jnp.int32), dst, dst_group=page_size)
    kernel = functools.partial(
        _kv_write_kernel,
        page_size=page_size,
        dynamic=_engine.uses_dynamic_dma(interpret),
    )
    return _engine.dma_call(
        kernel,
        (starts, num_runs, dst),
        (new_kv, cache),
        out_shape=_engine.out_like(cache),
        aliases={1: 0},  # the cache, updated in place
        bytes_accessed=2 * new_kv.size * new_kv.dtype.itemsize,
        interpret=interpret,
        name="kv_write",
    )


def write_kv(cache: jax.Array, new_kv: jax.Array, loc: jax.Array, *, interpret: Interpret = None) -> jax.Array:
    """Write ``new_kv[i]`` into token slot ``loc[i]`` of ``cache``; return the new cache.

    Args:
      cache: ``[pages + 1, page_size, 2 * kv_heads, head_dim_padded]``, any dtype (bytes are
        moved, never converted). Donate it under ``jit`` for an in-place write.
      new_kv: ``[n, 2 * kv_heads, head_dim_padded]``, the dtype of ``cache``.
      loc: integer ``[n]`` token slot ids; those on the trash page or out of range are dropped.
      interpret: ``None`` -> compiled Pallas on TPU, jnp reference elsewhere; ``True`` -> HLO
        interpreter; ``pltpu.InterpretParams`` -> TPU interpreter.

    Shape or dtype mismatches raise at trace time, naming the argument.
    """
    _engine.check_array("cache", cache, (None, None, None, None), what=_WHAT_CACHE)
    _, _, heads, dim = cache.shape
    _engine.check_array(
        "new_kv", new_kv, (None, heads, dim), cache.dtype, what="[tokens, 2 * kv_heads, head_dim_padded], cache dtype"
    )
    loc = _engine.as_ids("loc", loc)
    if loc.shape[0] != new_kv.shape[0]:
        raise ValueError(f"loc has shape {list(loc.shape)}; expected [{new_kv.shape[0]}] (one slot per row of new_kv)")
    if new_kv.shape[0] == 0:
        return cache
    return _engine.dispatch(write_kv_kernel, write_kv_reference, cache, new_kv, loc, interpret=interpret)
