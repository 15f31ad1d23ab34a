"""`MatchResult`: what ``match_prefix`` returns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class MatchResult:
    """The longest cached prefix of a key.

    Attributes:
        indices: int32 KV slot ids of the matched prefix, one per key element (a fresh array,
            built on first access; see below).
        last_node: the node where the match ends (the root for no match; None for a chunk
            cache). Lock it with ``inc_lock_ref`` to keep the prefix from being evicted.
        prefix_len: ``len(indices)``, in key elements (tokens; tokens - 1 with bigram keys).

    SGLang's names are aliases: ``device_indices``, ``last_device_node``, ``last_host_node``.

    Lazy indices. A tree match builds the result from the matched nodes' slot arrays and only
    concatenates them when ``indices`` is first read: callers that just lock ``last_node``
    (about 1 µs of a ~15 µs request on 1,000-token prefixes) never pay for the copy. The
    result is the same as an eager copy because tree nodes never write into their slot arrays
    (splits and evictions replace ``node.value``, they do not mutate it), so the parts hold the
    ids they held at match time even if the tree changes before ``indices`` is read.
    """

    __slots__ = ("_indices", "_parts", "last_node", "prefix_len")

    def __init__(self, indices: np.ndarray, last_node: Any, prefix_len: int | None = None) -> None:
        self._indices = indices
        self._parts: Sequence[np.ndarray] | None = None
        self.last_node = last_node
        self.prefix_len = int(indices.shape[0]) if prefix_len is None else prefix_len

    @classmethod
    def from_parts(cls, parts: Sequence[np.ndarray], last_node: Any, prefix_len: int) -> MatchResult:
        """A result whose ``indices`` are the first ``prefix_len`` ids of ``parts`` (int32
        arrays, never written to afterwards), concatenated on first access."""
        r = cls.__new__(cls)
        r._indices = None
        r._parts = parts
        r.last_node = last_node
        r.prefix_len = prefix_len
        return r

    @property
    def indices(self) -> np.ndarray:
        a = self._indices
        if a is None:
            parts = self._parts
            a = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
            if a.shape[0] != self.prefix_len:
                a = a[: self.prefix_len].copy()
            self._indices = a
            self._parts = None
        return a

    @indices.setter
    def indices(self, value: np.ndarray) -> None:
        self._indices = value
        self._parts = None

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
