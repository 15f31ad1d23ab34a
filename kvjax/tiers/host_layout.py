"""The host pool's memory layouts (SGLang's ``hicache_mem_layout``), page-granular.

A transfer moves pages as the page gather/scatter kernels pack them: a buffer
``[num_layers, n, page_size, C, D]`` (``C``, ``D``: the device pool's per-token row, e.g.
``2 * kv_heads`` and the padded head dim of an MHA pool). The host keeps those bytes in one numpy
array per pool:

==============  ======================================  ==========================================
layout          storage shape                            SGLang's token-granular equivalent
==============  ======================================  ==========================================
``layer_first``  ``[num_layers, pages, page_size, C, D]``  ``(2, L, size, H, D)``: one layer's slots
                                                          contiguous (per-layer loads)
``page_first``   ``[pages, num_layers, page_size, C, D]``  ``(2, size, L, H, D)``: one page of every
                                                          layer contiguous (one memcpy per page)
==============  ======================================  ==========================================

K and V stay interleaved on the ``C`` axis as the device pool stores them (SGLang stacks K and V
on a leading axis; kvjax moves the device rows as they are, so a page is one contiguous run).
``page_first_direct`` and ``page_head`` are not built (``NotImplementedError`` naming them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvjax.tiers.page_runs import copy_pages, page_runs

HOST_LAYOUTS = ("layer_first", "page_first")
_NOT_BUILT = ("page_first_direct", "page_head")


@dataclass(frozen=True)
class HostLayout:
    """Where page ``p`` of layer ``l`` lives in the host array (see module docstring)."""

    name: str

    def __post_init__(self) -> None:
        if self.name in _NOT_BUILT:
            raise NotImplementedError(
                f"hicache_mem_layout={self.name!r} is not built; use one of {', '.join(HOST_LAYOUTS)}"
            )
        if self.name not in HOST_LAYOUTS:
            raise ValueError(f"hicache_mem_layout={self.name!r}: use one of {', '.join(HOST_LAYOUTS)}")

    def shape(self, num_layers: int, num_pages: int, page_row: tuple[int, ...]) -> tuple[int, ...]:
        """The storage shape for ``num_pages`` pages of ``page_row = (page_size, C, D)``."""
        if self.name == "layer_first":
            return (num_layers, num_pages, *page_row)
        return (num_pages, num_layers, *page_row)

    def layer_view(self, storage: np.ndarray, layer: int) -> np.ndarray:
        """The pages of one layer, ``[pages, page_size, C, D]``, a view of ``storage`` (contiguous
        for ``layer_first``, strided for ``page_first``)."""
        return storage[layer] if self.name == "layer_first" else storage[:, layer]

    def write(self, storage: np.ndarray, pages: np.ndarray, buffer: np.ndarray) -> None:
        """``storage[page pages[i] of layer l] = buffer[l, i]`` (buffer layer-first, as gathered),
        by runs of consecutive pages (``page_runs.copy_pages``)."""
        index = np.arange(len(pages))
        runs = page_runs(index, pages)
        for layer in range(buffer.shape[0]):
            copy_pages(self.layer_view(storage, layer), pages, buffer[layer], index, runs)

    def read(self, storage: np.ndarray, pages: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The layer-first buffer ``[L, n, page_size, C, D]`` of ``pages``, into ``out`` when given
        (any array of that shape, e.g. a larger buffer's leading pages), else a new array."""
        num_layers = storage.shape[0 if self.name == "layer_first" else 1]
        if out is None:
            out = np.empty((num_layers, len(pages), *storage.shape[2:]), storage.dtype)
        index = np.arange(len(pages))
        runs = page_runs(pages, index)
        for layer in range(num_layers):
            copy_pages(out[layer], index, self.layer_view(storage, layer), pages, runs)
        return out
