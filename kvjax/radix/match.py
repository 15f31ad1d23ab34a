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

    Component results (SGLang 0.5.23's extra ``MatchResult`` fields). Components may shorten a
    match (``shorten_to``) and add results under their name in :attr:`extras` (a state slot to
    copy on write, a host-hit length). :attr:`full_kv_hit_length` is SGLang's: the FULL KV the
    walk found on the device or the host, before any component shortened the match;
    :attr:`device_kv_hit_length` the device part of it alone; :attr:`walk_node` the deepest node
    the walk reached, host-only nodes included (``last_node`` without host-only nodes).

    Lazy indices. A tree match builds the result from the matched nodes' slot arrays and only
    concatenates them when ``indices`` is first read: callers that just lock ``last_node``
    (about 1 µs of a ~15 µs request on 1,000-token prefixes) never pay for the copy. The
    result is the same as an eager copy because tree nodes never write into their slot arrays
    (splits and evictions replace ``node.value``, they do not mutate it), so the parts hold the
    ids they held at match time even if the tree changes before ``indices`` is read.
    """

    __slots__ = ("_indices", "_parts", "last_node", "prefix_len")

    def __init__(self, indices: np.ndarray, last_node: Any, prefix_len: int | None = None) -> None:
        self._indices: np.ndarray | None = indices
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
    def extras(self) -> dict[str, Any]:
        """Per-component results, by component name (none for a FULL-only tree)."""
        return {}

    @property
    def full_kv_hit_length(self) -> int:
        """Key elements of FULL KV available on the device or the host, before components
        shortened the match (SGLang 0.5.23's meaning; without a host tier, the device match)."""
        return self.prefix_len

    @property
    def device_kv_hit_length(self) -> int:
        """Key elements of FULL KV on the device, before components shortened the match
        (``full_kv_hit_length`` less what only the host holds)."""
        return self.prefix_len

    @property
    def walk_node(self) -> Any:
        """The deepest node the match walked (host-only nodes included)."""
        return self.last_node

    @property
    def indices(self) -> np.ndarray:
        a = self._indices
        if a is None:
            parts = self._parts
            if not parts or self.prefix_len == 0:
                a = np.empty(0, dtype=np.int32)
            else:
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


class ComponentMatchResult(MatchResult):
    """A match in a tree with components: they may shorten it (:meth:`shorten_to`) and add
    results (:attr:`extras`). A subclass so that the FULL-only hot path builds no more than
    :class:`MatchResult`."""

    __slots__ = ("_dev", "_extras", "_full", "_walk")
    _extras: dict[str, Any]
    _dev: int
    _full: int
    _walk: Any

    @classmethod
    def from_walk(
        cls, parts: Sequence[np.ndarray], last_node: Any, prefix_len: int, walk_node: Any
    ) -> ComponentMatchResult:
        """The device match ``(parts, last_node, prefix_len)``; ``walk_node``: the deepest node
        walked when it lies below ``last_node`` (host-only nodes), else None."""
        r = cls.__new__(cls)
        r._indices = None
        r._parts = parts
        r.last_node = last_node
        r.prefix_len = prefix_len
        r._extras = {}
        r._dev = prefix_len
        r._full = prefix_len
        r._walk = walk_node
        return r

    @property
    def extras(self) -> dict[str, Any]:
        return self._extras

    @property
    def full_kv_hit_length(self) -> int:
        return self._full

    @property
    def device_kv_hit_length(self) -> int:
        return self._dev

    def add_host_kv_hit(self, n: int) -> None:
        """A host tier holds FULL KV for ``n`` more key elements right below the device walk:
        they count in ``full_kv_hit_length`` (not in the device match)."""
        if n < 0:
            raise ValueError(f"add_host_kv_hit: n={n} must be >= 0")
        self._full += n

    @property
    def walk_node(self) -> Any:
        return self.last_node if self._walk is None else self._walk

    @property
    def host_hit_length(self) -> int:
        """Key elements past the device match that a host tier can load back (0 without one)."""
        host = self._extras.get("host")
        return 0 if host is None else host.host_hit_length

    @property
    def last_host_node(self) -> Any:
        """The deepest node a host tier can load back up to (``last_node`` without a host hit)."""
        host = self._extras.get("host")
        return self.last_node if host is None else host.last_host_node

    def shorten_to(self, node: Any, root: Any) -> None:
        """Make the match end at ``node`` (an ancestor-or-self of ``last_node``, or ``root``):
        ``prefix_len`` becomes its depth and ``indices`` its path's slots."""
        depth = 0 if node is root else int(node.depth)
        if depth > self.prefix_len:
            raise ValueError(f"shorten_to: node at depth {depth} is below the match ({self.prefix_len})")
        if self._walk is None:
            self._walk = self.last_node
        if self._indices is not None:
            self._indices = self._indices[:depth].copy()
        self.last_node = node
        self.prefix_len = depth
