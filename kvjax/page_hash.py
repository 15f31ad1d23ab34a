"""`PageHasher`: the chained, seeded hash of a page of token ids, the one the tree's KV events
carry by default and the storage tier keys its pages by (jax-free, no other kvjax import); and
`BlockHasher`, what any other page hash a tree's events may carry provides (``kvjax.kv_events``
has vLLM's ``sha256_cbor``, the one routers recompute from token ids)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

__all__ = ["BlockHasher", "PageHasher"]


class BlockHasher(Protocol):
    """A chained page hash a tree's KV events may carry (``RadixTree.start_events``).

    Invariant: the hash of page ``j`` of a key depends only on the tokens of pages ``0..j`` and
    the key's namespace (``extra_key``), so a node's hashes never change, a split cuts the list
    at a page boundary and a router that holds the token ids recomputes them.
    """

    #: The algorithm's name (``"kvjax"``, ``"sha256_cbor"``).
    name: str

    def page_hashes(self, parent: Any, tokens: Sequence[int], page_size: int, extra_key: Hashable) -> list[Any]:
        """The stored hashes of the ``len(tokens) // page_size`` whole pages of ``tokens``,
        chained from ``parent`` (the stored hash of the page before; None at a key's start,
        where ``extra_key`` enters)."""
        ...

    def wire_hash(self, stored: Any) -> int | bytes:
        """A stored hash as KV events carry it on the wire (an int, or bytes)."""
        ...


class PageHasher:
    """Chained, seeded page hashes.

    Args:
        seed: mixed into the first page's hash of every key (same seed, same hashes across
            processes: routers can compare them).
    """

    def __init__(self, seed: int | bytes | str = 0) -> None:
        if isinstance(seed, int):
            seed = seed.to_bytes(16, "little", signed=True)
        elif isinstance(seed, str):
            seed = seed.encode()
        self._seed = bytes(seed)
        self._roots: dict[Hashable, bytes] = {}

    def root(self, extra_key: Hashable) -> bytes:
        """The chain's starting value for namespace ``extra_key``."""
        r = self._roots.get(extra_key)
        if r is None:
            r = hashlib.sha256(self._seed + b"\x00" + repr(extra_key).encode()).digest()[:8]
            self._roots[extra_key] = r
        return r

    def chain(self, prior: bytes, data: bytes, page_bytes: int, stride_bytes: int, n_pages: int) -> list[int]:
        """Hashes of ``n_pages`` pages of ``data``; page ``j`` is
        ``data[j * stride_bytes : j * stride_bytes + page_bytes]`` (``page_bytes`` exceeds the
        stride by one token for bigram keys). Returns int64 hashes."""
        priors: list[bytes] = []
        append = priors.append
        sha = hashlib.sha256
        s = 0
        for _ in range(n_pages):
            prior = sha(prior + data[s : s + page_bytes]).digest()[:8]
            append(prior)
            s += stride_bytes
        # int64 little-endian, all at once (_to_int64 of each)
        return list(struct.unpack(f"<{n_pages}q", b"".join(priors)))

    name = "kvjax"

    def page_hashes(self, parent: int | None, tokens: Sequence[int], page_size: int, extra_key: Hashable) -> list[int]:
        """`BlockHasher.page_hashes`: the int64 hashes of the whole pages of ``tokens`` (int32
        token ids), chained from ``parent`` (None: from ``extra_key``'s root)."""
        n_pages = len(tokens) // page_size
        prior = self.root(extra_key) if parent is None else self.as_bytes(parent)
        data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens[: n_pages * page_size])
        return self.chain(prior, data, page_size * 4, page_size * 4, n_pages)

    @staticmethod
    def wire_hash(stored: int) -> int:
        """`BlockHasher.wire_hash`: the int64 hash itself."""
        return stored

    @staticmethod
    def as_bytes(h: int) -> bytes:
        """The chain value of a stored hash (inverse of the int64 truncation)."""
        return h.to_bytes(8, "little", signed=True)


def _to_int64(digest: bytes) -> int:
    """The first 8 bytes of ``digest`` as a signed little-endian int64 (the events' hash type)."""
    return int.from_bytes(digest[:8], "little", signed=True)
