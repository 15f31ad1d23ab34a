"""`HostPages`: the host pool's page data as the storage tier's stores read and write it.

Its own module so the storage link and the second stores beside it (``storage_window``,
``storage_checkpoint``) name it without importing each other.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

__all__ = ["HostPages"]


class HostPages(Protocol):
    """The host pool's page data (``kvjax.tiers.HostKVPool``): layer-first buffers
    ``[num_layers, n, page_size, C, D]`` of the pages of host slots."""

    def read_pages(self, host_slots: Any, dtype: Any = None) -> np.ndarray: ...

    def write_pages(self, host_slots: Any, buffer: np.ndarray) -> None: ...
