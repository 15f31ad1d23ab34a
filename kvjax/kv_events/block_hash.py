"""`Sha256CborHasher`: vLLM's ``sha256_cbor`` block hash, the one a router recomputes from token
ids alone (jax-free, no dependency: the few CBOR forms it needs are encoded here).

vLLM (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``):

* ``sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True))``, a 32-byte digest;
* the chain starts at ``NONE_HASH = sha256_cbor(seed)``, the seed being the *string* in
  ``PYTHONHASHSEED`` (vLLM draws a random one when it is unset: no router could then agree);
* block ``j`` hashes ``(parent digest, tuple(block tokens), extra_keys)``, ``extra_keys`` None
  or a tuple; the request's ``cache_salt`` enters the first block's extra keys only, as
  ``(cache_salt,)`` (a LoRA name would enter every block's; kvjax has no LoRA);
* events carry ``int.from_bytes(digest, "big") & (2**64 - 1)`` (the digest's low 64 bits, an
  unsigned int) with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, or the digest itself.

kvjax's ``extra_key`` (SGLang's, a tenant's cache salt) plays ``cache_salt``: a tree node under
namespace ``extra_key`` hashes its sequence's first block with extra keys ``(extra_key,)``. An
empty salt is no salt, as in vLLM. The tree stores the digests (``node.hashes``); `wire_hash`
gives what the events carry.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence
from typing import Any

from kvjax.errors import ConfigError

__all__ = ["Sha256CborHasher", "canonical_cbor", "make_block_hasher"]

_MASK64 = (1 << 64) - 1


def _head(major: int, n: int) -> bytes:
    """A CBOR item head: major type ``major`` with argument ``n`` in its shortest form."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return struct.pack(">BH", m | 25, n)
    if n < 0x100000000:
        return struct.pack(">BI", m | 26, n)
    if n <= _MASK64:
        return struct.pack(">BQ", m | 27, n)
    raise ValueError(f"canonical_cbor: integer {n} does not fit 64 bits")


class _IntCodes(dict):
    """Each int's CBOR encoding, made on first use (token ids repeat: one dict lookup each)."""

    def __missing__(self, n: int) -> bytes:
        code = _head(0, n) if n >= 0 else _head(1, -1 - n)
        self[n] = code
        return code


_INT_CODES = _IntCodes()


def canonical_cbor(x: Any) -> bytes:
    """``x`` in canonical CBOR (RFC 8949 core deterministic encoding, as ``cbor2.dumps(x,
    canonical=True)`` writes it) for the forms block hashes use: None, bool, int (64-bit),
    bytes, str, and tuples or lists of these. Raises TypeError for any other type."""
    if x is None:
        return b"\xf6"
    if x is True:
        return b"\xf5"
    if x is False:
        return b"\xf4"
    if isinstance(x, int):
        return _INT_CODES[x]
    if isinstance(x, bytes):
        return _head(2, len(x)) + x
    if isinstance(x, str):
        b = x.encode("utf-8")
        return _head(3, len(b)) + b
    if isinstance(x, (tuple, list)):
        return _head(4, len(x)) + b"".join(map(canonical_cbor, x))
    raise TypeError(f"canonical_cbor: cannot encode {type(x).__name__} {x!r}")


def _sha256_cbor(x: Any) -> bytes:
    return hashlib.sha256(canonical_cbor(x)).digest()


class Sha256CborHasher:
    """vLLM's ``sha256_cbor`` chained block hash (module docstring); a ``BlockHasher``.

    Args:
        seed: the seed string (vLLM's ``PYTHONHASHSEED``: router and server must share it).
        int_hashes: events carry the digests' low 64 bits as unsigned ints (vLLM with
            ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); False: the 32-byte digests.
    """

    name = "sha256_cbor"

    def __init__(self, seed: str, *, int_hashes: bool = True) -> None:
        if not isinstance(seed, str):
            raise ConfigError("hash_seed", seed, 'give the seed as a string, as PYTHONHASHSEED holds it (e.g. "0")')
        self.seed = seed
        self.int_hashes = bool(int_hashes)
        self.none_hash = _sha256_cbor(seed)

    def page_hashes(self, parent: bytes | None, tokens: Sequence[int], page_size: int, extra_key: Hashable) -> list:
        """The digests of the ``len(tokens) // page_size`` whole pages of ``tokens``, chained
        from ``parent`` (a digest; None: a sequence's start, ``NONE_HASH``, with ``extra_key`` as
        the first block's cache salt)."""
        sha = hashlib.sha256
        join = b"".join
        n_pages = len(tokens) // page_size
        prior = self.none_hash if parent is None else parent
        codes = list(map(_INT_CODES.__getitem__, tokens[: n_pages * page_size]))
        page_head = _head(4, page_size)
        none = b"\xf6"
        # the cache salt is the extra key of a sequence's first block only
        extra = canonical_cbor((extra_key,)) if parent is None and extra_key is not None and extra_key != "" else none
        out = []
        for j in range(n_pages):
            body = join(codes[j * page_size : (j + 1) * page_size])
            # (prior, tuple(page), extra keys): an array of three, written piece by piece.
            prior = sha(b"\x83\x58\x20" + prior + page_head + body + extra).digest()
            out.append(prior)
            extra = none
        return out

    def wire_hash(self, stored: bytes) -> int | bytes:
        """The event form of a digest: its low 64 bits as an unsigned int, or the digest."""
        return int.from_bytes(stored, "big") & _MASK64 if self.int_hashes else stored

    def hash_tokens(self, tokens: Sequence[int], page_size: int, cache_salt: Hashable = None) -> list[int | bytes]:
        """What a router computes: the event hashes of the whole pages of a request's
        ``tokens`` (under ``cache_salt``)."""
        return [self.wire_hash(h) for h in self.page_hashes(None, list(tokens), page_size, cache_salt)]


def make_block_hasher(name: str, seed: str | None) -> Any:
    """The hasher ``KVEventsConfig.block_hash`` names: None for ``"kvjax"`` (the tree keeps its
    own ``PageHasher``), a `Sha256CborHasher` of ``seed`` for ``"sha256_cbor"``.

    Raises ConfigError for ``"sha256_cbor"`` without a seed (vLLM would draw a random one that
    no router can know) or an unknown name."""
    if name == "kvjax":
        return None
    if name == "sha256_cbor":
        if seed is None:
            raise ConfigError(
                "hash_seed",
                None,
                'sha256_cbor needs the seed routers use: give "hash_seed" (or set PYTHONHASHSEED, as for vLLM)',
            )
        return Sha256CborHasher(seed)
    raise ConfigError("block_hash", name, "use 'kvjax' or 'sha256_cbor'")
