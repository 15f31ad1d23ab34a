"""Token keys: the two forms a request is walked in, and the slot-id checks at the boundary.

Measured on the development machine (CPython 3.11, 1,024-1,216-token keys, 2 shared cores):

===================================================  ==========
operation                                             time
===================================================  ==========
slice + compare ``list[int]``, int objects shared       1.4-2.1 µs
slice + compare ``list[int]``, distinct int objects     8-16 µs
pack a list to int32 ``bytes`` (``struct.pack``)        6-12 µs
``np.array(list, int32)`` / ``np.fromiter``             13-15 µs
numpy array ``.tobytes()``                              0.16 µs
numpy array ``.tolist()``                               12 µs
slice + compare ``bytes`` (memcmp)                      0.17 µs
:func:`list_starts_with`, 1,024 shared int objects       0.8 µs
slice a 1,216-token list (cold token objects)           ~4 µs
dict lookup by a 16-int ``tuple`` (incl. building it)   0.29 µs
===================================================  ==========

So converting a request costs as much as (distinct ints) or several times more than (shared
ints, the usual case when prompts are built by concatenating earlier turns) comparing it as a
list, and a conversion is paid on every call while a comparison only covers what matches.
Hence: **list inputs are walked as lists** — never copied; per node, one slice of that node's
window and one C-level list compare — and **numpy inputs as packed int32 bytes** (free to
produce, one memcmp per node). A node keeps its edge in whichever form it was created from and
builds the other lazily, once. Mismatch positions are found by bisecting slice compares
(lists) or with a zero-copy numpy view (bytes); KV-event hashing reads the bytes form.

The edges of the root's children hold the long shared prompts, and a request is compared with
one at offset 0, so there (edges of ``NO_COPY_COMPARE_MIN`` tokens or more) not even the window
slice is made: :func:`list_starts_with` decides with one list compare. The slice's cost is
mostly memory, not instructions: it increments, and later decrements, the reference count of
every token object in the window, which on a shared machine's cold cache costs more than the
compare itself (on the shared-prefix streams of ``benchmarks/compare_peers.py`` it removed a
quarter of the L1 data misses at the same instruction count).

For the same reason a new edge is the costliest step of an insert that misses: copying the key
writes every token object's reference count, and evicting the edge writes them all again. A key
the caller donates (``insert(..., donate_key=True)``, and every key the request lifecycle builds
for itself) becomes the edge as it is when nothing of it was cached, as SGLang's tree keeps the
caller's key object.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax.errors import InvalidSlotError

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
INT32 = np.dtype(np.int32)


def encode_tokens(tokens: Any, n: int | None = None) -> bytes:
    """The first ``n`` (default: all) token ids of ``tokens`` as native int32 bytes.

    ``tokens`` is a list/tuple of ints or a 1-D integer numpy array.

    Raises:
        ValueError: a token that is not an integer or does not fit in int32.
    """
    if isinstance(tokens, np.ndarray):
        a = tokens if n is None else tokens[:n]
        if a.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        if a.dtype != INT32:
            if a.dtype.kind not in "iu":
                raise ValueError(f"token_ids must be integers, got dtype {a.dtype}")
            if a.size and (int(a.min()) < _I32_MIN or int(a.max()) > _I32_MAX):
                raise ValueError("token_ids must fit in int32")
            a = a.astype(INT32)
        return a.tobytes()
    seq = tokens if n is None or n >= len(tokens) else tokens[:n]
    try:
        return struct.pack(f"{len(seq)}i", *seq)
    except struct.error as exc:
        raise ValueError(f"token_ids must be int32 integers: {exc}") from exc


# Edges at least this long are compared by :func:`list_starts_with` rather than by slicing the
# request. Measured with warm caches: the slice compare costs ~2.7 ns per token, the copy-free
# pass ~0.75 ns per token plus ~0.2 µs fixed (the call, the end marker appended and removed and
# its two method calls): 0.18 against 0.23 µs at 64 tokens, 0.47 against 0.28 µs at 128, so it
# wins from about a hundred tokens on, by more on a cold cache.
NO_COPY_COMPARE_MIN = 96


class _EdgeEnd:
    """The marker :func:`list_starts_with` puts after a head: it equals nothing, and its ``<``
    answers :data:`_REACHED`, a value no token compare can give."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    def __lt__(self, other: object) -> object:
        return _REACHED

    __hash__ = None  # type: ignore[assignment]


_REACHED = object()
_EDGE_END = _EdgeEnd()


def list_starts_with(src: list, head: list) -> bool:
    """Whether the token list ``src`` begins with ``head`` (``src[:len(head)] == head``), without
    copying a window of ``src``.

    A slice copies ``len(head)`` references and touches (increments, later decrements) the
    reference count of every token object in it, which on a cold request costs more than the
    compare. Here one lexicographic list compare decides instead: CPython's list compare walks
    to the first position where the items differ (skipping identical items with a pointer
    compare, so tokens shared with the edge cost nothing more) and returns the ``<`` of that
    pair, unconverted. ``head`` ends in a marker that equals no token, so the compare always
    stops at or before it: at the marker exactly when every token of ``head`` matched, and then
    the marker's ``<`` answers a private object that no compare of two tokens returns.
    ``head`` gets the marker appended and removed again (also when a compare raises), so callers
    pass a list they own.
    """
    n = len(head)
    if len(src) <= n:
        return len(src) == n and src == head
    head.append(_EDGE_END)
    try:
        return (head < src) is _REACHED
    finally:
        del head[n]


def decode_tokens(data: bytes) -> list[int]:
    """Inverse of :func:`encode_tokens`."""
    return np.frombuffer(data, dtype=INT32).tolist()


def as_slot_array(indices: Any, n: int, limit: int | None) -> np.ndarray:
    """Validated int32 copy-free view (or conversion) of ``indices`` for ``n`` key tokens.

    Args:
        indices: KV slot ids, a 1-D integer array or sequence of length ``n``.
        n: the number of tokens the slots belong to.
        limit: exclusive upper bound on slot ids (allocator capacity + page size), or None.

    Raises:
        ValueError: wrong length, shape or dtype (floats, bools).
        InvalidSlotError: a negative slot, or one >= ``limit``.
    """
    if type(indices) is np.ndarray and indices.dtype == INT32 and indices.ndim == 1 and indices.shape[0] == n:
        # Fast path (the common case). ``argmin`` / ``argmax`` are plain array methods, ~0.2 µs
        # on 1,200 ids against ~0.85 µs for a ufunc reduction's call overhead. With a limit,
        # one ``argmax`` over the unsigned view bounds both ends (negative ids become huge).
        if n:
            if limit is None:
                bad_found = indices.item(indices.argmin()) < 0
            else:
                u = indices.view(np.uint32)
                bad_found = u.item(u.argmax()) >= limit
            if bad_found:
                bound = limit if limit is not None else _I32_MAX
                bad = indices[(indices < 0) | (indices >= bound)]
                rng = f"[0, {limit})" if limit is not None else "[0, 2**31)"
                raise InvalidSlotError(f"insert: slot ids out of range {rng}: {bad[:8].tolist()}")
        return indices
    v = indices if isinstance(indices, np.ndarray) else np.asarray(indices)
    if v.ndim != 1 or v.shape[0] != n:
        raise ValueError(f"indices must be 1-D with one slot per token ({n}), got shape {v.shape}")
    if v.dtype.kind not in "iu":
        raise ValueError(f"indices must be an integer array (int32/int64), got dtype {v.dtype}")
    if n:
        # One reduction: viewed as unsigned, negative ids become huge, so a single max bounds
        # both ends (int64 views as uint64 the same way).
        u = (
            v.view(np.uint32 if v.dtype.itemsize == 4 else np.uint64)
            if v.dtype.kind == "i" and v.dtype.itemsize in (4, 8)
            else v
        )
        bound = limit if limit is not None else _I32_MAX + 1
        if int(u.max()) >= bound:
            bad = v[(v < 0) | (v >= bound)]
            rng = f"[0, {limit})" if limit is not None else "[0, 2**31)"
            raise InvalidSlotError(f"insert: slot ids out of range {rng}: {bad[:8].tolist()}")
    return v if v.dtype == INT32 else v.astype(INT32)


def token_count(tokens: Sequence[int] | np.ndarray) -> int:
    """``len(tokens)`` for lists, tuples and 1-D arrays."""
    return int(tokens.shape[0]) if isinstance(tokens, np.ndarray) else len(tokens)
