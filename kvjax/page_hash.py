"""`PageHasher`: the chained, seeded hash of a page of token ids, the one the tree's KV events
carry and the storage tier keys its pages by (jax-free, no other kvjax import)."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

__all__ = ["PageHasher"]


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
        out = []
        sha = hashlib.sha256
        for j in range(n_pages):
            s = j * stride_bytes
            prior = sha(prior + data[s : s + page_bytes]).digest()[:8]
            out.append(_to_int64(prior))
        return out

    @staticmethod
    def as_bytes(h: int) -> bytes:
        """The chain value of a stored hash (inverse of the int64 truncation)."""
        return h.to_bytes(8, "little", signed=True)


def _to_int64(digest: bytes) -> int:
    """The first 8 bytes of ``digest`` as a signed little-endian int64 (the events' hash type)."""
    return int.from_bytes(digest[:8], "little", signed=True)
