"""`MatchResult`: what ``match_prefix`` returns."""

from __future__ import annotations

from typing import Any

import numpy as np


class MatchResult:
    """The longest cached prefix of a key.

    Attributes:
        indices: int32 KV slot ids of the matched prefix, one per key element (a fresh array).
        last_node: the node where the match ends (the root for no match; None for a chunk
            cache). Lock it with ``inc_lock_ref`` to keep the prefix from being evicted.
        prefix_len: ``len(indices)``, in key elements (tokens; tokens - 1 with bigram keys).

    SGLang's names are aliases: ``device_indices``, ``last_device_node``, ``last_host_node``.
    """

    __slots__ = ("indices", "last_node", "prefix_len")

    def __init__(self, indices: np.ndarray, last_node: Any, prefix_len: int | None = None) -> None:
        self.indices = indices
        self.last_node = last_node
        self.prefix_len = int(indices.shape[0]) if prefix_len is None else prefix_len

    @property
    def device_indices(self) -> np.ndarray:
        return self.indices

    @property
    def last_device_node(self) -> Any:
        return self.last_node

    @property
    def last_host_node(self) -> Any:
        return self.last_node

    def __iter__(self):
        # Unpacks like SGLang's older (indices, last_node) tuple.
        yield self.indices
        yield self.last_node

    def __repr__(self) -> str:
        return f"MatchResult(prefix_len={self.prefix_len}, last_node={self.last_node!r})"
