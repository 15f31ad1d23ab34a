"""The storage tier (SGLang's HiCache L3): KV pages kept outside the host, keyed by chained page hashes.

A page's key is its chained hash (``kvjax.page_hash.PageHasher``: page ``j`` of a sequence
hashes ``(hash of page j-1, page tokens)`` from a seed mixed with the key's namespace), the same
hash the tree's KV events carry, so any process with the same seed finds the same pages. A page's
value is one entry (``kvjax.tiers.storage_entry``): a header naming its key and page, one page of
every layer in the host pool's ``page_first`` layout (``page_shape``, one dtype) as raw bytes, and
a crc32. Entries live under the digest of a :class:`~kvjax.tiers.storage_key.StorageKey` (the
model's weights fingerprint, KV dtype and scales, layout, page shape, TP rank, layers, user
namespace, format), so a cache never reads pages another model, layout or namespace wrote.

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

Pages of a pool sharded over tensor-parallel ranks (``shards``): each rank's heads of a page are
their own entry under that rank's key (``StorageKey.for_shard``), written together, and a page
counts as stored (a hit, a prefetched page) only when every shard's entry is there and verifies.

A read that fails, a missing entry, and an entry that fails verification (torn: wrong size;
another key's or page's header; another format; a checksum mismatch) are misses: the request
recomputes those tokens, and nothing is ever served from a partial or damaged page. The header is
checked when the store is asked what it holds; the checksum when a page is taken. Rejections are
counted (``StorageTier.rejected``, a warning once) and the entry is deleted, so the next backup of
that page writes it again. Nothing here raises to the serving loop for a bad entry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.page_hash import PageHasher
from kvjax.tiers.storage_entry import check_header, decode_entry, encode_entry
from kvjax.tiers.storage_key import StorageKey

logger = logging.getLogger("kvjax.tiers.storage")
MANIFEST = "key.json"  # the StorageKey record, next to its pages

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def page_hashes(
    tokens: Sequence[int] | np.ndarray,
    page_size: int,
    *,
    extra_key: Hashable = None,
    seed: int | bytes | str = 0,
    prior_hash: int | None = None,
    bigram: bool = False,
) -> list[int]:
    """The chained hashes of the whole pages of ``tokens`` (a trailing partial page has none).

    ``prior_hash``: the hash of the page before ``tokens[0]`` (continue a chain from a matched
    prefix); None starts the chain at the namespace root of ``extra_key``. ``bigram``: EAGLE's
    bigram keys, whose key element ``i`` is the token pair ``(i, i + 1)``: ``tokens`` hold one
    token more than the elements, and page ``j`` hashes the ``page_size + 1`` tokens from
    ``j * page_size`` (SGLang's bigram page hash). Equal to the hashes the tree's KV events carry
    for the same pages with the same ``seed``.
    """
    if page_size < 1:
        raise ConfigError("page_size", page_size, "use an integer >= 1")
    extra = int(bigram)
    n_pages = max(0, len(tokens) - extra) // page_size
    if n_pages == 0:
        return []
    hasher = PageHasher(seed)
    prior = hasher.root(extra_key) if prior_hash is None else PageHasher.as_bytes(prior_hash)
    count = n_pages * page_size + extra
    data = struct.pack(f"{count}i", *[int(t) for t in tokens[:count]])
    return hasher.chain(prior, data, (page_size + extra) * 4, page_size * 4, n_pages)


def _kvstore_spec(location: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(location, dict):
        return location
    if location == "memory":
        return {"driver": "memory"}
    return {"driver": "file", "path": location.rstrip("/") + "/"}


class StorageTier:
    """Pages by chained hash in a tensorstore key-value store, under one :class:`StorageKey`.

    Args:
        location: a directory (the ``file`` driver), ``"memory"``, a tensorstore kvstore spec, or
            a store already open (a ``tensorstore.KvStore``, or an object with its future-returning
            ``read``/``write``: tests pass one that injects faults).
        key: what determines the pages' bytes (model fingerprint, KV dtype and scales, layout,
            page shape, TP rank/size, layers, namespace, format); pages live under its digest and
            only entries written under an equal key are ever read.
        shards: for pages of a pool sharded over tensor-parallel ranks (the host page holds
            every distinct head, ``kvjax.tiers.head_shards``): ``(tp_rank, heads)`` per shard,
            ``heads`` a slice of the page's head axis (``page_shape[2]``). Each shard of a page
            is its own entry under ``key.for_shard(tp_rank, ...)`` (its own digest folder), so
            a reader of another TP size (another key) never reads it; a page is stored, present
            and taken only when every shard's entry is (written together, verified each).
            Empty: one entry per page under ``key``.
        partial_shards: ``shards`` may cover part of the head axis (in order, not overlapping):
            across processes each one stores and reads only its own devices' heads of a page
            (``kvjax.transfers.storage_attach.local_head_blocks``); the other heads of a page it reads
            are left unset (that process never reads them). False: they must tile it.

    Counters: ``pages_written``, ``pages_read`` (pages served), ``rejected`` (entries refused,
    by reason: see ``kvjax.tiers.storage_entry.REJECT_REASONS``); the first rejection logs a
    warning. A rejected entry is deleted (best effort), so a later backup writes it again.
    """

    def __init__(
        self,
        location: str | dict[str, Any] | Any,
        *,
        key: StorageKey,
        shards: Sequence[tuple[int, slice]] = (),
        partial_shards: bool = False,
    ) -> None:
        import tensorstore as ts

        if not isinstance(key, StorageKey):
            raise ConfigError("key", type(key).__name__, "pass a kvjax.tiers.storage_key.StorageKey")
        self.storage_key = key
        self.page_shape = key.page_shape
        self.dtype = np.dtype(key.store_dtype)
        self.page_bytes = key.page_bytes
        self.shards = _check_shards(key, shards, partial_shards)
        self.partial_shards = partial_shards
        self.shard_keys = tuple(key.for_shard(rank, _width(heads)) for rank, heads in self.shards) or (key,)
        self._prefixes = tuple(k.digest for k in self.shard_keys)
        self.prefix = self._prefixes[0]  # the (first) entry's folder
        opened = not isinstance(location, (str, dict)) and hasattr(location, "read") and hasattr(location, "write")
        self._kv: Any = location if opened else ts.KvStore.open(_kvstore_spec(location)).result()
        self._side_writes: list[Any] = []  # the key record and deletions of rejected entries
        self._manifest_written = False
        self.pages_written = 0
        self.pages_read = 0
        self.rejected: Counter[str] = Counter()

    def key(self, page_hash: int, shard: int = 0) -> str:
        """The store key of a page's entry (of its ``shard``): the entry key's digest ``/`` the hash
        as 16 hex digits."""
        return f"{self._prefixes[shard]}/{int(page_hash) & 0xFFFFFFFFFFFFFFFF:016x}"

    def _reads(self, page_hash: int) -> Any:
        """Start reading a page's entries: a future, or one per shard (:class:`ShardFutures`)."""
        if not self.shards:
            return self._kv.read(self.key(page_hash))
        return ShardFutures(tuple(self._kv.read(self.key(page_hash, i)) for i in range(len(self.shards))))

    def flush(self) -> None:
        """Wait for the tier's own writes (the key record, deletions of refused entries); a
        backup's writes are waited on through its :class:`StorageWrite`. A failed one is ignored."""
        side, self._side_writes = self._side_writes, []
        for future in side:
            try:
                future.result()
            except Exception:  # best effort, as the deletion itself
                continue

    @property
    def rejected_entries(self) -> int:
        """Entries refused so far (torn, corrupt, foreign), each counted as a miss."""
        return sum(self.rejected.values())

    # --- entries --------------------------------------------------------------------------------

    def _read(self, future: Any) -> Any:
        """The result of a finished read that found a value; None when absent or the read
        failed (a miss). Per-shard reads: the first shard's (waiting for every shard)."""
        if isinstance(future, ShardFutures):
            results = [self._read(f) for f in future.parts]
            return results[0] if all(r is not None for r in results) else None
        try:
            result = future.result()
        except Exception:  # a failed read is a miss
            return None
        return result if result.state == "value" else None

    def _present(self, page_hash: int, future: Any, *, repair: bool = True) -> bool:
        """Whether a finished read found an entry of this key and page with the right size
        (the header only; the checksum is verified when the page is taken); per-shard reads:
        every shard's. ``repair``: delete a rejected entry (off when the caller is about to
        overwrite it)."""
        if isinstance(future, ShardFutures):
            return all(self._present_entry(page_hash, f, i, repair) for i, f in enumerate(future.parts))
        return self._present_entry(page_hash, future, 0, repair)

    def _present_entry(self, page_hash: int, future: Any, shard: int, repair: bool) -> bool:
        result = self._read(future)
        if result is None:
            return False
        key = self.shard_keys[shard]
        reason = check_header(result.value, key.version, self._prefixes[shard], page_hash, key.page_bytes)
        if reason is not None:
            self._reject(page_hash, reason, result.stamp.generation if repair else None, shard)
            return False
        return True

    def _page(self, page_hash: int, future: Any) -> memoryview | None:
        """The verified page bytes of a finished read, or None (a miss; rejections counted);
        per-shard reads: the page assembled from every shard's verified entry."""
        if not isinstance(future, ShardFutures):
            return self._entry(page_hash, future, 0)
        page = np.empty(self.page_shape, self.dtype)
        for i, (part, (_, heads)) in enumerate(zip(future.parts, self.shards, strict=True)):
            payload = self._entry(page_hash, part, i)
            if payload is None:
                return None
            page[:, :, heads] = np.frombuffer(payload, self.dtype).reshape(self.shard_keys[i].page_shape)
        return page.reshape(-1).view(np.uint8).data

    def _entry(self, page_hash: int, future: Any, shard: int) -> memoryview | None:
        result = self._read(future)
        if result is None:
            return None
        key = self.shard_keys[shard]
        payload, reason = decode_entry(result.value, key.version, self._prefixes[shard], page_hash, key.page_bytes)
        if reason is not None:
            self._reject(page_hash, reason, result.stamp.generation, shard)
        return payload

    def _reject(self, page_hash: int, reason: str, generation: bytes | None, shard: int = 0) -> None:
        """Count a refused entry (a warning the first time) and delete it when ``generation``
        is given: only that version of it, so a valid entry written meanwhile survives."""
        if not self.rejected:
            logger.warning(
                "storage tier: refused entry %s (%s); such entries are misses and get rewritten "
                "(this warning is shown once; StorageTier.rejected counts them)",
                self.key(page_hash, shard),
                reason,
            )
        self.rejected[reason] += 1
        if generation is not None:
            self._side_writes = [f for f in self._side_writes if not f.done()]
            self._side_writes.append(self._kv.write(self.key(page_hash, shard), None, if_equal=generation))

    # --- presence -------------------------------------------------------------------------------

    def contains(self, page_hash: int) -> bool:
        """Whether the store holds an entry of this key for ``page_hash`` (a blocking read)."""
        return self._present(page_hash, self._reads(page_hash))

    def present(self, hashes: Sequence[int]) -> list[bool]:
        """Whether the store holds each of ``hashes`` (every shard's entry; reads issued together),
        in order: holes included, unlike :meth:`leading_hits`."""
        futures = [self._reads(h) for h in hashes]
        return [self._present(h, future) for h, future in zip(hashes, futures, strict=True)]

    def leading_hits(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the store holds (every shard's entry; reads
        issued together)."""
        futures = [self._reads(h) for h in hashes]
        count = 0
        for h, future in zip(hashes, futures, strict=True):
            if not self._present(h, future):
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
        if not self._manifest_written:
            for key, prefix in zip(self.shard_keys, self._prefixes, strict=True):
                record = json.dumps(key.to_dict(), indent=1, sort_keys=True).encode()
                self._side_writes.append(self._kv.write(f"{prefix}/{MANIFEST}", record))
            self._manifest_written = True
        present = [self._reads(h) for h in hashes]
        futures: list[Any] = []
        skipped = 0
        for h, page, seen in zip(hashes, pages, present, strict=True):
            if self._present(h, seen, repair=False):
                skipped += 1
                continue
            if not self.shards:
                futures.append(self._kv.write(self.key(h), self._encode(h, page, 0)))
                continue
            parts = [
                self._kv.write(self.key(h, i), self._encode(h, page[:, :, heads], i))
                for i, (_, heads) in enumerate(self.shards)
            ]
            futures.append(ShardFutures(tuple(parts)))
        self.pages_written += len(futures)
        return StorageWrite(futures, skipped)

    def _encode(self, page_hash: int, page: np.ndarray, shard: int) -> bytes:
        data = np.ascontiguousarray(page).reshape(-1).view(np.uint8).data
        return encode_entry(self.shard_keys[shard].version, self._prefixes[shard], page_hash, data)

    # --- reads ----------------------------------------------------------------------------------

    def prefetch(self, hashes: Sequence[int]) -> Prefetch:
        """Start reading the pages of ``hashes`` (those that follow a match, in order)."""
        return Prefetch(self, list(hashes), [self._reads(h) for h in hashes])

    def get(self, hashes: Sequence[int]) -> np.ndarray:
        """The leading run of stored, verified pages of ``hashes``, waiting for every read:
        ``[k, *page_shape]`` with ``k <= len(hashes)``."""
        return self.prefetch(hashes).take("wait_complete")

    def _decode(self, hashes: Sequence[int], futures: Sequence[Any]) -> np.ndarray:
        """The pages of the finished reads ``futures``, up to the first that fails verification."""
        payloads = []
        for h, future in zip(hashes, futures, strict=True):
            payload = self._page(h, future)
            if payload is None:
                break
            payloads.append(payload)
        pages = np.empty((len(payloads), *self.page_shape), self.dtype)
        for i, payload in enumerate(payloads):
            pages[i] = np.frombuffer(payload, self.dtype).reshape(self.page_shape)
        self.pages_read += len(payloads)
        return pages


def _width(heads: slice) -> int:
    return int(heads.stop) - int(heads.start)


def _check_shards(
    key: StorageKey, shards: Sequence[tuple[int, slice]], partial: bool = False
) -> tuple[tuple[int, slice], ...]:
    """``shards`` as a tuple, after checking they tile the page's head axis in order with distinct
    ranks (``partial``: lie on it in order without overlapping); ConfigError naming them otherwise."""
    out = tuple((int(rank), heads) for rank, heads in shards)
    if not out:
        return out
    heads_axis = key.page_shape[2] if len(key.page_shape) >= 4 else 0
    starts = [0] + [int(h.stop) for _, h in out[:-1]]
    ok = (
        heads_axis > 0
        and all(
            h.step in (None, 1) and h.stop > h.start and (h.start >= s if partial else h.start == s)
            for (_, h), s in zip(out, starts, strict=True)
        )
        and (out[-1][1].stop <= heads_axis if partial else out[-1][1].stop == heads_axis)
        and len({r for r, _ in out}) == len(out)
    )
    if not ok:
        raise ConfigError(
            "shards",
            [(r, (h.start, h.stop)) for r, h in out],
            f"give (distinct tp_rank, heads) slices {'on' if partial else 'tiling'} the head axis of the page "
            f"{key.page_shape} in order",
        )
    return out


class ShardFutures:
    """The futures of one page's per-shard entries (reads or writes), as one: done once all are,
    its ``result`` raises when any failed, ``cancel`` cancels all."""

    def __init__(self, parts: tuple[Any, ...]) -> None:
        self.parts = parts

    def done(self) -> bool:
        return all(f.done() for f in self.parts)

    def result(self) -> Any:
        return [f.result() for f in self.parts]

    def cancel(self) -> None:
        for f in self.parts:
            f.cancel()


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

    def __init__(self, tier: StorageTier, hashes: list[int], futures: list[Any]) -> None:
        self._tier = tier
        self._hashes = hashes
        self._futures = futures
        self._headers_ok: dict[int, bool] = {}  # verdicts on finished reads, each judged once
        self.taken: int | None = None

    def __len__(self) -> int:
        return len(self._futures)

    def done(self) -> bool:
        """True once every read finished (successfully or not); never blocks."""
        return all(f.done() for f in self._futures)

    def arrived(self) -> int:
        """Pages of the leading run that have arrived so far with a valid header (never blocks;
        the checksum is verified by :meth:`take`)."""
        count = 0
        for i, (h, future) in enumerate(zip(self._hashes, self._futures, strict=True)):
            if not future.done():
                break
            if i not in self._headers_ok:
                self._headers_ok[i] = self._tier._present(h, future)
            if not self._headers_ok[i]:
                break
            count += 1
        return count

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
                self._tier._read(future)  # blocks until the read finished (a failure is a miss)
        elif policy == "timeout":
            deadline = time.monotonic() + timeout_s
            while not all(f.done() for f in self._futures) and time.monotonic() < deadline:
                time.sleep(0.0005)
        count = self.arrived()
        for future in self._futures[count:]:
            if not future.done():
                future.cancel()
        self.taken = count
        return self._tier._decode(self._hashes[:count], self._futures[:count])
