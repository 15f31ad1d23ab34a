"""`EmbeddingCache`: the vision encoder's outputs, byte-bounded and least-recently-used first out
(SGLang's ``MultiModalStaticCache`` behind ``init_mm_embedding_cache(SGLANG_VLM_CACHE_SIZE_MB)``).

An entry is one multimodal item's encoder output, keyed by the item's content hash
(``kvjax.multimodal.item_hash.hash_item``): an image seen again skips the encoder. Values may be
any array with an ``nbytes`` (numpy, jax); the cache never reads or copies them.

Semantics (SGLang's, per item: its ``get_single`` / ``set``):

* :meth:`get` returns the entry or None; a hit makes the entry the most recently used.
* :meth:`put` of a key already held only makes it the most recently used (the held value stays).
  Otherwise the least recently used entries are evicted until the new one fits, and it is kept.
* An item larger than the whole cache is served but not kept (:meth:`put` returns False), and
  nothing is evicted for it. SGLang evicts every entry first, then refuses; kvjax decides before
  evicting, so one oversized image does not empty the cache.
* A cache of 0 bytes keeps nothing but items of 0 bytes.

Invariants, after every call: ``bytes_used <= max_bytes``; ``bytes_used`` is the sum of the held
entries' ``nbytes`` (read once, at :meth:`put`); the order of entries is the order of their last
use (:meth:`get` hit or :meth:`put`).

Same decision on every rank: hits, misses, evictions and what is kept depend only on the sequence
of calls, their keys and their values' ``nbytes`` (never on the values, the clock, an id or a
process-local hash), and content hashes are equal in every process. So the ranks of a
tensor-parallel group, or processes serving the same requests in the same order, hold the same
keys and make the same hit/miss decision for every item; each keeps its own copy of the values.

Units: bytes. Counters (:meth:`stats`): ``hits`` and ``misses`` count :meth:`get` calls;
``evictions`` and ``evicted_bytes`` count entries removed to make room; ``not_kept`` counts
:meth:`put` calls refused as larger than the cache; ``bytes_used`` and ``entries`` are the
current contents.

Where kvjax differs: SGLang also caches a request's items together under a combined hash (its
path for items with several offsets); kvjax caches one entry per item only. SGLang's cache is a
process-wide global; kvjax's is an object the serving loop owns (sized from
``CacheConfig.vlm_cache_size_mb``, SGLang's ``SGLANG_VLM_CACHE_SIZE_MB``, through the plan's
``mm_embedding_cache_bytes``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.plan import CachePlan

__all__ = ["EmbeddingCache", "EmbeddingCacheStats"]

E = TypeVar("E")

_HASH_LIMIT = 1 << 64


@dataclasses.dataclass(frozen=True)
class EmbeddingCacheStats:
    """A snapshot of an `EmbeddingCache`'s counters and contents (bytes in bytes)."""

    max_bytes: int
    bytes_used: int
    entries: int
    hits: int
    misses: int
    evictions: int
    evicted_bytes: int
    not_kept: int

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)``; 0.0 before the first lookup."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


def _check_key(key: Any) -> int:
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < _HASH_LIMIT:
        raise ValueError(f"key={key!r}: give an item's content hash, an int in [0, 2**64) (hash_item)")
    return key


def _nbytes(value: Any) -> int:
    size = getattr(value, "nbytes", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(
            f"a value of type {type(value).__name__} with nbytes={size!r}: give an array (numpy or jax) whose "
            "nbytes is its size in bytes"
        )
    return size


class EmbeddingCache(Generic[E]):
    """Byte-bounded LRU cache of encoder outputs, keyed by content hash (module docstring).

    Args:
        max_bytes: the bound on the held entries' bytes, an int >= 0.
    """

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes!r}: give the cache's size in bytes, an int >= 0")
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[int, tuple[E, int]] = collections.OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.not_kept = 0

    @classmethod
    def from_plan(cls, plan: CachePlan) -> EmbeddingCache[Any]:
        """A cache of the plan's ``mm_embedding_cache_bytes`` (``vlm_cache_size_mb`` MiB)."""
        return cls(int(plan.mm_embedding_cache_bytes))

    @classmethod
    def from_config(cls, config: CacheConfig) -> EmbeddingCache[Any]:
        """A cache of ``config.vlm_cache_size_mb`` MiB (what the plan records)."""
        return cls(int(config.vlm_cache_size_mb) * 1024 * 1024)

    # -- lookups -------------------------------------------------------------------------------

    def get(self, key: int) -> E | None:
        """The entry under ``key`` (now the most recently used), or None; counts a hit or a miss."""
        key = _check_key(key)
        held = self._entries.get(key)
        if held is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return held[0]

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is held; counts nothing and changes no order."""
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        """The held entries' bytes (``<= max_bytes``)."""
        return self._bytes

    def keys(self) -> list[int]:
        """The held keys, least recently used first."""
        return list(self._entries)

    # -- updates -------------------------------------------------------------------------------

    def put(self, key: int, value: E) -> bool:
        """Keep ``value`` under ``key``, evicting least recently used entries to make room.

        Returns whether ``key`` is held afterwards: True when it was already held (only its
        recency changes) or was kept; False when ``value`` is larger than the whole cache (then
        nothing changed but the ``not_kept`` counter).

        Raises:
            ValueError: ``key`` is not a content hash or ``value`` has no ``nbytes`` (nothing changed).
        """
        key = _check_key(key)
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        size = _nbytes(value)
        if size > self.max_bytes:
            self.not_kept += 1
            return False
        while self._bytes + size > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted
            self.evictions += 1
            self.evicted_bytes += evicted
        self._entries[key] = (value, size)
        self._bytes += size
        return True

    def get_or_encode(self, key: int, encode: Callable[[], E]) -> tuple[E, bool]:
        """The entry under ``key``, else ``encode()`` (then kept if it fits); returns
        ``(value, hit)``. ``encode`` runs only on a miss."""
        held = self.get(key)
        if held is not None:
            return held, True
        value = encode()
        self.put(key, value)
        return value, False

    def discard(self, key: int) -> bool:
        """Drop ``key``'s entry (not an eviction: no counter changes); returns whether it was held."""
        held = self._entries.pop(_check_key(key), None)
        if held is None:
            return False
        self._bytes -= held[1]
        return True

    def clear(self) -> None:
        """Drop every entry; the counters stay."""
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> EmbeddingCacheStats:
        """The counters and the contents' size now."""
        return EmbeddingCacheStats(
            max_bytes=self.max_bytes,
            bytes_used=self._bytes,
            entries=len(self._entries),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            evicted_bytes=self.evicted_bytes,
            not_kept=self.not_kept,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError unless the bytes add up and stay within the bound."""
        total = sum(size for _, size in self._entries.values())
        assert total == self._bytes, f"bytes_used {self._bytes} != held entries' bytes {total}"
        assert self._bytes <= self.max_bytes, f"bytes_used {self._bytes} > max_bytes {self.max_bytes}"
