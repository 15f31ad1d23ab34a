"""`cached_prefix_len`: how many leading tokens a prefix tree holds, read without changing it.

A router asks every DP rank's tree how much of a request it already holds before the request is
admitted anywhere. ``match_prefix`` cannot answer that: it splits the node where the match ends,
stamps access times (LRU order), counts the query in the tree's statistics and, when admitted,
locks the path. The probe here walks the same edges and changes nothing: no split, no lock, no
access time, no statistics, no lazily cached key form.

What it counts is the device part of a FULL-KV match, page-aligned: the ``prefix_len`` that
``match_prefix(tokens, extra_key)`` would return on a tree without components (a tree with
components, such as a sliding-window or recurrent-state one, may shorten a real match below
it; the probe is then an upper bound). Host-only nodes end the count, as they end a device
match. A disabled tree (a chunk cache) or one with ``force_miss`` set holds nothing.

Cost: O(depth) dictionary lookups and one list compare per edge on the path, in Python.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

__all__ = ["cached_prefix_len"]


def cached_prefix_len(tree: Any, tokens: Sequence[int] | np.ndarray, extra_key: Hashable = None) -> int:
    """Key elements (tokens; tokens - 1 with bigram keys) of ``tokens`` that ``tree`` holds on
    the device, page-aligned, in namespace ``extra_key``; ``tree`` is left exactly as it was.

    Args:
        tree: a kvjax prefix tree (``RadixCache`` or a preset built on it; a chunk cache holds
            nothing and answers 0).
        tokens: the token ids to look up (a list, tuple or 1-D integer array).
        extra_key: the prefix namespace (LoRA id, cache salt); None for the default one.

    Returns:
        The length ``tree.match_prefix(tokens, extra_key).prefix_len`` would report before any
        component shortens the match, between 0 and ``len(tokens)``.
    """
    if _holds_nothing(tree):
        return 0
    src = np.asarray(tokens).reshape(-1).tolist() if isinstance(tokens, np.ndarray) else [int(t) for t in tokens]
    page = int(tree.page_size)
    ex = 1 if getattr(tree, "is_eagle", False) else 0
    n = len(src) - ex
    n -= n % page
    if n <= 0:
        return 0
    node = tree.root
    off = 0
    while off < n:
        child = tree.find_child(node, src, off, extra_key)
        if child is None or child.value is None:  # not cached, or host-only: the device match ends
            break
        edge = child.edge()
        limit = min(int(child.klen), n - off)
        shared = _shared_elements(edge, src, off, limit, ex)
        shared -= shared % page
        off += shared
        if shared < child.klen:
            break
        node = child
    return off


def _holds_nothing(tree: Any) -> bool:
    is_chunk = getattr(tree, "is_chunk_cache", None)
    if callable(is_chunk) and is_chunk():
        return True
    return bool(getattr(tree, "force_miss", False)) or getattr(tree, "root", None) is None


def _shared_elements(edge: list[int], src: list[int], off: int, limit: int, ex: int) -> int:
    """Leading key elements (at most ``limit``) that ``edge`` and ``src[off:]`` share; a key
    element covers ``1 + ex`` tokens, so element ``i`` needs tokens ``i .. i + ex`` equal."""
    span = limit + ex
    if src[off : off + span] == edge[:span]:
        return limit
    same = 0
    while same < span and src[off + same] == edge[same]:
        same += 1
    return max(0, same - ex)
