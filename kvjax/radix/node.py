"""`TreeNode`: one edge of the radix tree (a run of whole pages) and its bookkeeping.

Key representation (measured, see ``keys.py``): a node's edge is kept in up to two forms,
each built once, lazily, from the other: ``klist`` (a ``list[int]``, what list inputs compare
against with one C-level list compare) and ``key`` (native int32 ``bytes``, what numpy inputs
compare against with a memcmp). Requests are never copied; they are walked by offsets and only
the window of one edge is sliced out per node. A leaf added by an insert whose key was donated
and partly cached may hold neither form yet, only ``kshare``: the donated list, whose tail from
``kshare_from`` is the edge; the list form is cut from it when first needed (most such leaves
are evicted unread, and not copying their tokens spares touching every token object twice: a
copy and a release, each a cache miss per token on a request that arrives cold).

Invariants (checked by ``RadixCache.sanity_check``):
  * ``klen`` is a multiple of the page size and ``len(value) == klen`` while cached;
  * with bigram (EAGLE) keys the edge covers ``klen + 1`` tokens (element ``i`` is the pair of
    tokens ``i, i + 1``); otherwise ``klen`` tokens; ``key`` or ``klist`` is set, or else
    ``kshare`` (None while either is set) with ``kshare[kshare_from:]`` the edge;
  * ``depth`` = key elements from the root through the end of this node;
  * ``parent.children[ckey] is self``. ``ckey``, the child key: the first token of the edge,
    except where several children of the parent began with that token (it is in
    ``parent.clash``): then the tuple of the tokens the first page covers (SGLang's key for page
    sizes above 1; ``page + 1`` tokens with bigram keys). Under the root a child of a namespace
    (``extra_key`` set) is filed under ``(extra_key, SGLang's key)``, SGLang's own key;
  * ``parent.lock_ref >= sum(child.lock_ref for child in children)``;
  * residency (``residency``): ``DEVICE`` — in the tree, ``value`` holds its device slots;
    ``HOST_ONLY`` — in the tree with its device copy gone (``value is None``) because a component
    (a host tier) still holds a copy or it has host-only children; ``DELETED`` — detached, every
    component's data released. Device-resident nodes form a root-closed subtree: a host-only
    node has only host-only descendants, and is never locked (``lock_ref == 0``);
  * ``comp`` holds per-component data keyed by component name; a component whose key is absent
    on a node has a *tombstone* there (its data was never there or was evicted).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Hashable
from typing import Any

import numpy as np

#: ``TreeNode.retain_until`` of a node that was never retained (before any clock reading;
#: ``kvjax.radix.retention`` re-exports it).
NO_RETENTION = float("-inf")

_ids = itertools.count()

# ``TreeNode.residency`` values.
DELETED = 0
"""Detached from the tree: its KV (and every component's data on it) was released."""
DEVICE = 1
"""In the tree with its device copy: ``value`` holds the node's device slot ids."""
HOST_ONLY = 2
"""In the tree without a device copy (``value is None``): kept by a component's copy (a host
tier) or by host-only children. A match's device part ends above it; an insert over it makes
it device-resident again from the incoming slots."""
RESIDENCY_NAMES = {DELETED: "deleted", DEVICE: "device", HOST_ONLY: "host-only"}


class TreeNode:
    """A radix-tree node. Plain slots: the tree's hot loops read and write them directly.

    Attributes:
        id: unique, increasing id (for printing and stable tie-breaking).
        parent: the parent node (None for the root and for evicted nodes).
        children: child nodes by child key (see module docstring).
        clash: first tokens that several children began with (None until one did): children
            beginning with them are keyed by their first page (module docstring), the others
            by their first token alone, which a walk looks up without building and hashing a
            page tuple; its edge compare then confirms the whole page.
        key: native int32 bytes of this edge's tokens, or None until first needed.
        klist: this edge's tokens as a list, or None until first needed.
        kshare: a donated key list holding this edge from ``kshare_from`` to its end, kept
            instead of ``klist`` and ``key`` until either is needed; else None.
        kshare_from: where the edge starts in ``kshare`` (set with it; unset otherwise).
        ckey: this node's key in ``parent.children``.
        klen: key elements (= KV slots) on this edge.
        depth: key elements from the root to the end of this edge.
        value: int32 device KV slot ids, one per key element (owned; never mutated in place,
            splits take views); None unless ``residency == DEVICE``.
        residency: ``DEVICE``, ``HOST_ONLY`` or ``DELETED`` (module constants).
        lock_ref: how many locks pass through this node (a lock on a node counts on every
            ancestor up to, not including, the root).
        last_access: logical time of the last match/insert through this node.
        creation: logical time the node was created.
        hit_count: inserts that reused this node (SGLang counts at insert, not chunked).
        priority: max priority over the requests that inserted through this node.
        retain_priority / retain_until: the node's retention (``retention.py``): retained while
            ``retain_until`` (seconds on the tree's retention clock) is after the clock's
            reading, at priority ``retain_priority``; ``retention.NO_RETENTION`` when never
            retained.
        extra_key: the namespace (LoRA id, cache salt) of the key; None for the default one.
        hashes: per-page chained block hashes (int64), computed when KV events are on.
        heap_seq: sequence number of this node's live entry in the eviction heap (-1: none,
            -2: queued for a push).
        owner: token of the tree generation that created the node (reset invalidates it).
        comp: per-component data (dict component name -> that component's object), or None
            when no component has data here; an absent name is that component's tombstone.
    """

    __slots__ = (
        "id",
        "parent",
        "children",
        "clash",
        "key",
        "klist",
        "kshare",
        "kshare_from",
        "ckey",
        "klen",
        "depth",
        "value",
        "residency",
        "lock_ref",
        "last_access",
        "creation",
        "hit_count",
        "priority",
        "retain_priority",
        "retain_until",
        "extra_key",
        "hashes",
        "heap_seq",
        "owner",
        "comp",
    )

    # The root's ``parent`` is None; every other node's is set before it is linked, so the
    # tree's walks read it as a node.
    parent: TreeNode
    # SGLang's child key: a token (page size 1) or a tuple of tokens, ``(extra_key, ...)`` at the root.
    ckey: Any
    # Set together with ``kshare`` (read only while ``kshare`` is set).
    kshare_from: int

    def __init__(
        self,
        owner: object,
        t: int,
        parent: TreeNode | None = None,
        klist: list | None = None,
        key: bytes | None = None,
        klen: int = 0,
        depth: int = 0,
        value: np.ndarray | None = None,
        priority: int = 0,
        hit_count: int = 0,
        extra_key: Hashable = None,
    ) -> None:
        # The tree's walks pass a new edge's fields here: one store each instead of a default
        # store and an overwrite (node creation is on every insert's path).
        self.id = next(_ids)
        self.parent = parent  # type: ignore[assignment]
        self.children: dict[Any, TreeNode] = {}
        self.clash: set[int] | None = None
        self.key = key
        self.klist = klist
        self.kshare: list | None = None
        self.ckey = None
        self.klen = klen
        self.depth = depth
        self.value = value
        self.residency = DEVICE
        self.lock_ref = 0
        self.last_access = t
        self.creation = t
        self.hit_count = hit_count
        self.priority = priority
        self.retain_priority = 0
        self.retain_until = NO_RETENTION
        self.extra_key = extra_key
        self.hashes: list[int] | None = None
        self.heap_seq = -1
        self.owner = owner
        self.comp: dict[str, Any] | None = None

    @property
    def evicted(self) -> bool:
        """True once the node's device KV slots were freed (SGLang's ``value is None``): the
        node is either detached (``deleted``) or still in the tree host-only."""
        return self.value is None

    @property
    def deleted(self) -> bool:
        """True once the node is detached from the tree."""
        return self.residency == DELETED

    @property
    def host_only(self) -> bool:
        """True while the node is in the tree without a device copy."""
        return self.residency == HOST_ONLY

    def token_ids(self) -> list[int]:
        """The tokens of this edge (``klen`` tokens, ``klen + 1`` with bigram keys), a copy."""
        if self.klist is not None:
            return list(self.klist)
        return self.edge()

    def edge(self) -> list[int]:
        """The tokens of this edge: the node's own list when it has one (read it, never change
        it), else a new one."""
        if self.klist is not None:
            return self.klist
        if self.kshare is not None:
            return self.kshare[self.kshare_from :]
        return np.frombuffer(self.key or b"", dtype=np.int32).tolist()

    def token_at(self, i: int) -> int:
        """Token ``i`` of this edge (``0 <= i`` < the edge's length), read in place from whichever
        form the node holds (no list is built)."""
        if self.klist is not None:
            return int(self.klist[i])
        if self.kshare is not None:
            return int(self.kshare[self.kshare_from + i])
        return int.from_bytes((self.key or b"")[4 * i : 4 * i + 4], sys.byteorder, signed=True)

    def __lt__(self, other: TreeNode) -> bool:
        # SGLang orders nodes by access time for heap tie-breaks; kept for compatibility.
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        toks = self.token_ids()
        more = "..." if len(toks) > 10 else ""
        state = RESIDENCY_NAMES[self.residency] if self.residency != DEVICE else f"lock_ref={self.lock_ref}"
        return f"TreeNode(id={self.id}, len={self.klen}, tokens={toks[:10]}{more}, {state})"
