"""`serving_digest`: a fingerprint of one process's serving state, and `compare_digests`, which
names the first difference between processes.

Every process of a multi-process run keeps its own tree, allocator and request table; they must
stay equal, or the processes write different slots of one sharded pool. A digest is one short
hash per part, so digests of all processes can be gathered every step (``KVJAX_CHECK_AGREEMENT=1``
on the command line, always in the tests) and compared part by part:

* ``tree``: every node (depth-first, children in key order) with its edge's tokens, its slots,
  its lock count and its residency (device, host, both);
* ``allocator``: the free and release lists in order (the next allocation's slots) and the page
  bitmap (``backup_state``), or the free size for an allocator without snapshots;
* ``request_table``: the free rows in order and the slots of every row in use;
* ``requests``: each queued, running and chunked request's id, length, output and row.

Under DP attention every rank's scheduler gives these parts, and ``routing`` says which rank
each request went to.

Invariant: equal states give equal digests on every process (no object ids, no addresses, no
wall-clock time enters a digest). Digests travel as text (``dict[str, str]``) inside typed
messages (``wire``): the step message's ``digest`` field, or a `StateDigest` of their own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvjax.multihost.errors import DivergenceError
from kvjax.multihost.wire import wire_message

__all__ = ["PARTS", "StateDigest", "compare_digests", "serving_digest"]

PARTS = ("tree", "allocator", "request_table", "requests")


@wire_message("digest", version=1)
@dataclass(frozen=True)
class StateDigest:
    """One process's digest as it travels on its own: each part's hash, by part name."""

    parts: dict[str, str]


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=12)


def _feed(h: Any, *values: Any) -> None:
    for v in values:
        if isinstance(v, np.ndarray):
            h.update(str(v.dtype).encode())
            h.update(np.ascontiguousarray(v).tobytes())
        else:
            h.update(repr(v).encode())
        h.update(b"|")


def tree_digest(tree: Any) -> str:
    """The tree's nodes, depth first (see the module docstring); a tree without nodes (a chunk
    cache) digests its evictable and protected sizes."""
    h = _hasher()
    root = getattr(tree, "root", None)
    if root is None:
        _feed(h, tree.evictable_size(), tree.protected_size())
        return h.hexdigest()
    stack = [root]
    while stack:
        node = stack.pop()
        value = node.value if isinstance(node.value, np.ndarray) else np.asarray([], np.int64)
        _feed(h, node.depth, _key_content(node.key), value.astype(np.int64, copy=False), node.lock_ref)
        _feed(h, str(node.residency))
        stack.extend(node.children[k] for k in sorted(node.children, key=repr, reverse=True))
    _feed(h, tree.evictable_size(), tree.protected_size())
    return h.hexdigest()


def _key_content(key: Any) -> Any:
    """An edge's key as hashable content: bytes as they are, a token list as an array."""
    if key is None or isinstance(key, (bytes, bytearray, np.ndarray)):
        return key
    try:
        return np.asarray(key)
    except (TypeError, ValueError):
        return repr(key)


def allocator_digest(alloc: Any) -> str:
    h = _hasher()
    if hasattr(alloc, "backup_state"):
        _feed_snapshot(h, alloc.backup_state())
    else:
        _feed(h, alloc.available_size())
    return h.hexdigest()


def _feed_snapshot(h: Any, snapshot: Any) -> None:
    """Hash a snapshot dataclass field by field (nested snapshots, as a hybrid allocator's, too)."""
    if not dataclasses.is_dataclass(snapshot):
        _feed(h, snapshot)
        return
    for field in dataclasses.fields(snapshot):
        _feed(h, field.name)
        _feed_snapshot(h, getattr(snapshot, field.name))


def request_table_digest(rows: Any) -> str:
    h = _hasher()
    free = np.asarray(rows.free_slots, np.int64)
    used = np.setdiff1d(np.arange(rows.size), free)
    _feed(h, free, used, rows.req_to_token[used])
    return h.hexdigest()


def requests_digest(groups: Iterable[tuple[str, Sequence[Any]]]) -> str:
    h = _hasher()
    for name, reqs in groups:
        _feed(h, name)
        for r in reqs:
            _feed(h, r.rid, r.seqlen(), tuple(r.output_ids), r.kv_committed_len, r.req_pool_idx)
    return h.hexdigest()


def serving_digest(scheduler: Any) -> dict[str, str]:
    """The digest of a ``Scheduler``'s state, part by part (``PARTS``); of a DP front
    (``kvjax.dp.DPScheduler``: a scheduler per rank) every rank's parts, named ``rank R PART``,
    and ``routing``, the rank every request went to."""
    ranks = getattr(scheduler, "schedulers", None)
    if ranks is not None:
        parts = {f"rank {r} {part}": h for r, s in enumerate(ranks) for part, h in serving_digest(s).items()}
        routing = _hasher()
        _feed(routing, sorted((repr(rid), rank) for rid, rank in scheduler.rank_of.items()))
        return {**parts, "routing": routing.hexdigest()}
    chunked = [scheduler.chunked] if scheduler.chunked is not None else []
    return {
        "tree": tree_digest(scheduler.tree),
        "allocator": allocator_digest(scheduler.alloc),
        "request_table": request_table_digest(scheduler.rows),
        "requests": requests_digest(
            (("waiting", list(scheduler.waiting)), ("running", scheduler.running), ("chunked", chunked))
        ),
    }


def compare_digests(step: int, digests: Sequence[dict[str, str]]) -> None:
    """Raise ``DivergenceError`` naming ``step``, the processes and the parts whose digests differ
    from process 0's; nothing when all are equal."""
    first = digests[0]
    for q, other in enumerate(digests[1:], start=1):
        differ = [part for part in first if other.get(part) != first[part]]
        if differ:
            raise DivergenceError(
                step,
                f"step {step}: process {q}'s {', '.join(differ)} differ(s) from process 0's; the processes' serving "
                "state diverged (every decision must come out the same on every process)",
            )
