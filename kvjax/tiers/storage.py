"""The storage tier (SGLang's HiCache L3): KV pages kept outside the host, keyed by chained page hashes.

A page's key is its chained hash (``kvjax.radix.events.PageHasher``: page ``j`` of a sequence
hashes ``(hash of page j-1, page tokens)`` from a seed mixed with the key's namespace), the same
hash the tree's KV events carry, so any process with the same seed finds the same pages. A page's
value is one page of every layer in the host pool's ``page_first`` layout (``page_shape``, one
dtype), stored as raw bytes; keys live under a ``namespace`` (the model and layout), so caches of
different models or layouts never read each other's pages.

The engine is tensorstore's key-value store: ``"file"`` (a local directory, the default),
``"memory"`` (tests), or any tensorstore kvstore spec. Every read and write is asynchronous
(tensorstore futures):

* :meth:`StorageTier.backup` starts writing pages (skipping pages the store already holds, as
  SGLang does) and returns a :class:`StorageWrite` to poll.
* :meth:`StorageTier.prefetch` starts reading the pages that follow a match, up to the first page
  the store lacks, and returns a :class:`Prefetch`. When the request is scheduled,
  :meth:`Prefetch.take` returns the pages that arrived, as SGLang's prefetch policies say:
  ``best_effort`` (whatever arrived by now, never waiting), ``wait_complete`` (wait for every page),
  ``timeout`` (wait up to ``timeout_s``, then what arrived). Pages are always a *leading* run:
  a page after a missing or late one is useless to a prefix match and is dropped.

A read that fails or returns a value of the wrong size counts as a miss (the request recomputes
those tokens); nothing is ever served from a partial page.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.radix.events import PageHasher

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def page_hashes(
    tokens: Sequence[int] | np.ndarray,
    page_size: int,
    *,
    extra_key: Hashable = None,
    seed: int | bytes | str = 0,
    prior_hash: int | None = None,
) -> list[int]:
    """The chained hashes of the whole pages of ``tokens`` (a trailing partial page has none).

    ``prior_hash``: the hash of the page before ``tokens[0]`` (continue a chain from a matched
    prefix); None starts the chain at the namespace root of ``extra_key``. Equal to the hashes the
    tree's KV events carry for the same pages with the same ``seed`` (page keys, not bigrams).
    """
    if page_size < 1:
        raise ConfigError("page_size", page_size, "use an integer >= 1")
    n_pages = len(tokens) // page_size
    if n_pages == 0:
        return []
    hasher = PageHasher(seed)
    prior = hasher.root(extra_key) if prior_hash is None else PageHasher.as_bytes(prior_hash)
    data = struct.pack(f"{n_pages * page_size}i", *[int(t) for t in tokens[: n_pages * page_size]])
    return hasher.chain(prior, data, page_size * 4, page_size * 4, n_pages)


def _kvstore_spec(location: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(location, dict):
        return location
    if location == "memory":
        return {"driver": "memory"}
    return {"driver": "file", "path": location.rstrip("/") + "/"}


class StorageTier:
    """Pages by chained hash in a tensorstore key-value store.

    Args:
        location: a directory (the ``file`` driver), ``"memory"``, or a tensorstore kvstore spec.
        page_shape: the shape of one stored page (every layer of one page, host ``page_first``
            layout), e.g. ``(layers, page_size, 2 * kv_heads, head_dim)``.
        dtype: the pages' dtype (the host pool's storage dtype).
        namespace: a key prefix naming the model and layout (no ``/``).

    Raises ConfigError naming a bad shape, dtype or namespace.
    """

    def __init__(
        self,
        location: str | dict[str, Any],
        *,
        page_shape: Sequence[int],
        dtype: Any,
        namespace: str = "kvjax",
    ) -> None:
        import tensorstore as ts

        shape = tuple(int(d) for d in page_shape)
        if not shape or any(d <= 0 for d in shape):
            raise ConfigError("page_shape", tuple(page_shape), "give the positive shape of one page")
        if not namespace or "/" in namespace:
            raise ConfigError("namespace", namespace, "use a non-empty name without '/'")
        self.page_shape = shape
        self.dtype = np.dtype(dtype)
        self.page_bytes = int(np.prod(shape)) * self.dtype.itemsize
        self.namespace = namespace
        self._kv = ts.KvStore.open(_kvstore_spec(location)).result()
        self.pages_written = 0
        self.pages_read = 0

    def key(self, page_hash: int) -> str:
        """The store key of a page (``namespace/`` + the hash as 16 hex digits)."""
        return f"{self.namespace}/{int(page_hash) & 0xFFFFFFFFFFFFFFFF:016x}"

    # --- presence -------------------------------------------------------------------------------

    def contains(self, page_hash: int) -> bool:
        """Whether the store holds a page of the right size under ``page_hash`` (a blocking read)."""
        return self._stored(self._kv.read(self.key(page_hash)))

    def _stored(self, future: Any) -> bool:
        """Whether a finished read found a page of the right size (a failed read did not)."""
        try:
            result = future.result()
        except Exception:  # a failed read is a miss
            return False
        return bool(result.state == "value" and len(result.value) == self.page_bytes)

    def leading_hits(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the store holds (reads issued together)."""
        futures = [self._kv.read(self.key(h)) for h in hashes]
        count = 0
        for future in futures:
            if not self._stored(future):
                break
            count += 1
        return count

    # --- writes ---------------------------------------------------------------------------------

    def backup(self, hashes: Sequence[int], pages: np.ndarray) -> StorageWrite:
        """Start writing ``pages[i]`` under ``hashes[i]``; pages already stored are skipped.

        ``pages``: ``[len(hashes), *page_shape]`` of ``dtype``. Raises ConfigError (nothing
        written) for a count, shape or dtype mismatch.
        """
        pages = np.asarray(pages)
        if pages.shape != (len(hashes), *self.page_shape) or pages.dtype != self.dtype:
            raise ConfigError(
                "pages",
                f"{pages.dtype}{list(pages.shape)}",
                f"pass {len(hashes)} pages of {self.dtype}{list(self.page_shape)}",
            )
        present = [self._kv.read(self.key(h)) for h in hashes]
        futures = []
        skipped = 0
        for h, page, seen in zip(hashes, pages, present, strict=True):
            if self._stored(seen):
                skipped += 1
                continue
            futures.append(self._kv.write(self.key(h), np.ascontiguousarray(page).tobytes()))
        self.pages_written += len(futures)
        return StorageWrite(futures, skipped)

    # --- reads ----------------------------------------------------------------------------------

    def prefetch(self, hashes: Sequence[int]) -> Prefetch:
        """Start reading the pages of ``hashes`` (those that follow a match, in order)."""
        return Prefetch(self, [self._kv.read(self.key(h)) for h in hashes])

    def get(self, hashes: Sequence[int]) -> np.ndarray:
        """The leading run of stored pages of ``hashes``, waiting for every read:
        ``[k, *page_shape]`` with ``k <= len(hashes)``."""
        return self.prefetch(hashes).take("wait_complete")

    def _decode(self, results: list[Any]) -> np.ndarray:
        pages = np.empty((len(results), *self.page_shape), self.dtype)
        for i, result in enumerate(results):
            pages[i] = np.frombuffer(result.value, self.dtype).reshape(self.page_shape)
        self.pages_read += len(results)
        return pages


@dataclasses.dataclass
class StorageWrite:
    """Writes in flight. ``skipped``: pages that were already stored."""

    futures: list[Any]
    skipped: int = 0

    def done(self) -> bool:
        """True once every write finished (successfully or not)."""
        return all(f.done() for f in self.futures)

    def wait(self) -> int:
        """Wait for every write; returns how many landed (a failed write is not counted)."""
        landed = 0
        for future in self.futures:
            try:
                future.result()
                landed += 1
            except Exception:  # a failed backup leaves the page absent: later reads miss it
                continue
        return landed


class Prefetch:
    """Reads of consecutive pages in flight (see :meth:`StorageTier.prefetch`)."""

    def __init__(self, tier: StorageTier, futures: list[Any]) -> None:
        self._tier = tier
        self._futures = futures
        self.taken: int | None = None

    def __len__(self) -> int:
        return len(self._futures)

    def done(self) -> bool:
        """True once every read finished (successfully or not); never blocks."""
        return all(f.done() for f in self._futures)

    def arrived(self) -> int:
        """Pages of the leading run that have arrived so far, valid ones only (never blocks)."""
        count = 0
        for future in self._futures:
            if not future.done() or not self._valid(future):
                break
            count += 1
        return count

    def _valid(self, future: Any) -> bool:
        try:
            result = future.result()
        except Exception:  # a failed read is a miss
            return False
        return bool(result.state == "value" and len(result.value) == self._tier.page_bytes)

    def take(self, policy: str = "best_effort", timeout_s: float = 0.0) -> np.ndarray:
        """The leading run of pages that arrived, per ``policy`` (see the module docstring);
        ``[k, *page_shape]``. Reads still in flight are abandoned. Taken once.

        Raises ConfigError for an unknown policy or a negative timeout, RuntimeError when taken twice.
        """
        if policy not in PREFETCH_POLICIES:
            raise ConfigError("prefetch policy", policy, f"use one of {list(PREFETCH_POLICIES)}")
        if not timeout_s >= 0:
            raise ConfigError("timeout_s", timeout_s, "use a timeout >= 0 seconds")
        if self.taken is not None:
            raise RuntimeError(f"this prefetch was taken already ({self.taken} pages)")
        if policy == "wait_complete":
            for future in self._futures:
                self._valid(future)  # blocks until the read finished (a failure is a miss)
        elif policy == "timeout":
            deadline = time.monotonic() + timeout_s
            while not all(f.done() for f in self._futures) and time.monotonic() < deadline:
                time.sleep(0.0005)
        count = self.arrived()
        for future in self._futures[count:]:
            if not future.done():
                future.cancel()
        self.taken = count
        return self._tier._decode([self._futures[i].result() for i in range(count)])
