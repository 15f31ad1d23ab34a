"""The tree's state: construction, node key forms, events, sizes and whole-tree views.

The tree is one class built in layers, one concept per module, each a single-inheritance step
on the one before (no mixins, no diamond):

==========================  ===================================================================
``tree_state.py``           ``TreeState``: fields, counters, key forms, events, sizes, views
``host_residency.py``       ``HostResidency``: host-only nodes, demotion, deletion, revival
``walk.py``                 ``TreeWalk``: the one walk for match and insert, splits, new nodes
``path_locks.py``           ``PathLocks``: lock counts along root paths, receipts
``tree.py``                 ``RadixTree``: eviction, reset, invariants (the class to use)
``eviction_heap.py``        ``EvictionHeap``: FULL's candidates and lazy heap (composed)
``invariants.py``           ``check_core_invariants``: the whole-tree check (a function)
==========================  ===================================================================

Components (``component.py``) use only the public surface (``root``, ``nodes()``,
``evictable_leaves``, ``split_node``, ``delete_leaf``, ``revive_node``, ``add_host_only_leaf``,
``synthesize_slots``, lock and size methods); the underscored fields are the layers' own.

Costs (n = key elements of the call, d = depth of the path, L = evictable leaves):
  * match / insert from the root: per node on the path, one dict lookup and one C-level compare
    of that node's edge (a list slice compare, or a memcmp for numpy inputs packed once). No
    Python loop over tokens; the request is never copied or re-sliced as a whole.
  * resumed insert (request lifecycle): O(new tokens + nodes below the resume point); nothing
    proportional to the already-cached prefix is copied or compared.
  * lock / unlock: O(d). evict: O(k log L) for k evicted nodes, plus the heap pushes queued
    since the last eviction for leaves that are still evictable (a persistent heap, see
    ``eviction_heap.py``), never a rebuild over all leaves per call.
  * a child is found by its first token (outside the root's namespaces), not by building and
    hashing a page tuple; only first tokens that several children began with are keyed by page
    (``TreeNode.clash``).
  * sizes: O(1) counters with ``evictable + protected == total``, per component.

With no component beside FULL the hot paths call no hook. Host-only nodes (a component kept a
node whose device copy was evicted) are handled off the fast paths too: the walks check for them
only while some exist.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator, Sequence, Set
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.page_hash import BlockHasher, PageHasher
from kvjax.radix.component import ComponentSizes, FullKVComponent, TreeComponent
from kvjax.radix.events import BlockStored, EventQueue, EventSink, KVEvent
from kvjax.radix.eviction import EvictionPolicy, get_eviction_policy, priority_function
from kvjax.radix.eviction_heap import EvictionHeap
from kvjax.radix.keys import INT32, decode_tokens
from kvjax.radix.node import DEVICE, RESIDENCY_NAMES, TreeNode
from kvjax.radix.retention import check_clock_reading
from kvjax.radix.stats import CacheStats

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol

_pack = struct.pack


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class TreeState:
    """Fields and bookkeeping of the tree core. See ``RadixCache`` for the public, checked API.

    ``trash_in_values``: device nodes may hold the trash slot 0 in ``value`` (a pure-SWA tree's
    tombstones, ``pure_swa_radix_cache.py``); FULL never frees it and the check that no slot is
    cached twice ignores it.

    Args:
        page_size: tokens per page (>= 1); edges and matches are whole pages.
        eviction_policy: a name from ``eviction.EVICTION_POLICIES`` or a policy object.
        allocator: where evicted slot ids are freed (None: free nothing, for simulation).
        is_eagle: bigram keys (EAGLE): key element ``i`` is the token pair ``(i, i + 1)``, so a
            key has one element fewer than its tokens.
        components: extra :class:`TreeComponent` objects beside FULL, each with a unique name:
            ``SWAComponent`` (``PureSWAComponent``), ``MambaComponent``, ``HostTierComponent``;
            the presets (``SWARadixCache``, ``MambaRadixCache``, ``HiRadixCache``, ...) attach them.
        enable_kv_cache_events / event_sink: emit KV events (to the sink, else queued for
            ``take_events``). A sink alone turns events on.
        hash_seed: seed of the chained page hashes in events.
        eviction_policy_config: keyword arguments for the policy (``slru``: protected_threshold).
    """

    trash_in_values = False

    # The tree's fields are slots, along the whole class chain up to ``RadixCache``: the hot
    # paths read and call through ``self`` a few hundred times per request, and CPython 3.11
    # specializes those for slots and for small instance dicts only. An instance dict shares at
    # most 30 keys per class; the tree has more fields, so its dict became a plain one, where
    # ``self.x`` reads a hashed slot and ``self.f()`` takes the generic method lookup (a
    # method-heavy loop ran ~35% slower). Presets add their own few fields in an instance dict.
    __slots__ = (
        "page_size",
        "is_eagle",
        "_ex",
        "_ck_len",
        "_simple_ck",
        "_ck_struct",
        "_first_struct",
        "policy",
        "eviction_policy",
        "_prio",
        "_eager",
        "_evq",
        "_leaves",
        "_full",
        "_extra",
        "components",
        "_by_name",
        "_tracker",
        "enable_kv_cache_events",
        "_events",
        "_hasher",
        "hash_seed",
        "stats",
        "force_miss",
        "_sim_next",
        "_cut_node",
        "_cut_tail",
        "_owner",
        "_clock",
        "root",
        "_evictable",
        "_protected",
        "_host_only",
    )

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        *,
        allocator: AllocatorProtocol | None = None,
        is_eagle: bool = False,
        components: Sequence[TreeComponent] = (),
        enable_kv_cache_events: bool = False,
        event_sink: EventSink | None = None,
        hash_seed: int | bytes | str = 0,
        eviction_policy_config: dict | None = None,
    ) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ConfigError("page_size", page_size, "use an integer >= 1")
        self.page_size = int(page_size)
        self.is_eagle = bool(is_eagle)
        self._ex = 1 if self.is_eagle else 0
        # SGLang's child key covers the first page's tokens (one more token for bigram pages);
        # for page size 1 without bigrams it is the bare first token. kvjax files children by
        # their first token, and by that page key only where first tokens clash (``TreeNode``):
        # a 16-token page tuple costs ~175 ns to build and hash, on every lookup, link and unlink.
        self._ck_len = self.page_size + self._ex
        self._simple_ck = self._ck_len == 1
        self._ck_struct = struct.Struct(f"{self._ck_len}i")
        self._first_struct = struct.Struct("i")
        self.policy = get_eviction_policy(eviction_policy, **(eviction_policy_config or {}))
        self.eviction_policy = self.policy.name
        self._prio = priority_function(self.policy)
        self._eager = not self.policy.monotone
        self._evq = EvictionHeap(self._prio)
        # FULL's eviction candidates: the heap's set, aliased for the hot paths (cleared in place).
        self._leaves: set[TreeNode] = self._evq.leaves
        self._full = FullKVComponent(allocator)
        self._full.attach(self)  # type: ignore[arg-type]  # the finished tree is a RadixTree
        self._extra: tuple[TreeComponent, ...] = tuple(components)
        names = [self._full.name] + [c.name for c in self._extra]
        if len(set(names)) != len(names):
            raise ConfigError("components", names, "give every component a unique name ('full' is FULL's)")
        for c in self._extra:
            c.attach(self)  # type: ignore[arg-type]
        self.components: tuple[TreeComponent, ...] = (self._full, *self._extra)
        self._by_name: dict[str, TreeComponent] = {c.name: c for c in self.components}
        # Per-component counts of what an ``evict({...})`` call freed by cascade (None outside).
        self._tracker: dict[str, int] | None = None
        events_on = bool(enable_kv_cache_events) or event_sink is not None
        self.enable_kv_cache_events = events_on
        self._events: EventQueue | None = EventQueue(event_sink) if events_on else None
        self._hasher: BlockHasher = PageHasher(hash_seed)
        self.hash_seed = hash_seed  # the page hashes' seed (events, a storage tier's keys)
        self.stats = CacheStats()
        # Measurement switch: every match walks (and splits) as usual but reports no hit.
        self.force_miss = False
        self._sim_next = self.page_size  # synthesized slot ids (simulation inserts) skip page 0
        # A list edge ``_common`` cut for the split that follows it (see ``TreeWalk._cut_confirms``).
        self._cut_node: TreeNode | None = None
        self._cut_tail: list | None = None
        self._clear()

    def _clear(self) -> None:
        # A fresh owner token: nodes (and receipts) of the previous generation are rejected.
        self._owner = object()
        self._clock = 0
        root = TreeNode(self._owner, 0)
        root.lock_ref = 1
        root.value = _frozen(np.empty(0, dtype=INT32))
        root.priority = -sys.maxsize
        root.hashes = []
        self.root = root
        self._evictable = 0  # FULL device tokens in unlocked nodes
        self._protected = 0  # FULL device tokens in locked nodes
        self._evq.clear()
        self._host_only = 0  # nodes in the tree without a device copy

    # ------------------------------------------------------------------ components

    @property
    def has_components(self) -> bool:
        """True when components beside FULL are attached (their hooks are then called)."""
        return bool(self._extra)

    def component(self, name: str) -> TreeComponent:
        """The component called ``name`` (``"full"`` for FULL). Raises KeyError naming the valid ones."""
        c = self._by_name.get(name)
        if c is None:
            raise KeyError(f"no component {name!r}; this tree has {', '.join(self._by_name)}")
        return c

    def owns(self, node: Any) -> bool:
        """Whether ``node`` is a node of this tree's current generation (not from another tree
        or from before ``reset``); deleted nodes of this generation count as owned."""
        return isinstance(node, TreeNode) and node.owner is self._owner

    @property
    def host_only_count(self) -> int:
        """Nodes in the tree whose device copy is gone (kept by a component)."""
        return self._host_only

    @property
    def root_node(self) -> TreeNode:
        """SGLang's name for :attr:`root`."""
        return self.root

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ retention clock

    @property
    def retention_now(self) -> float:
        """The retention clock's reading (seconds; ``retention.py``): what the serving loop last
        gave :meth:`advance_retention_clock` (0.0 until then)."""
        return self._evq.now

    def advance_retention_clock(self, now: float) -> float:
        """Set the retention clock to ``now`` (seconds, logical: the serving loop's agreed
        reading). The clock never runs backwards: an earlier reading is ignored. Retentions whose
        expiry the clock reached are ordinary nodes from now on (the eviction heap moves them at
        the next eviction). Returns the clock's reading.

        Raises ValueError (clock unchanged) for a reading that is not a finite number.
        """
        reading = check_clock_reading(now)
        evq = self._evq
        if reading > evq.now:
            evq.now = reading
        return evq.now

    # ------------------------------------------------------------------ key forms
    #
    # A request is walked in one of two forms: a list of ints (lists are never copied, only one
    # edge's window is sliced per node) or native int32 bytes (numpy inputs, packed once for
    # free). Each node keeps the matching form of its edge, made from the other on first use.

    def _klist(self, node: TreeNode) -> list:
        kl = node.klist
        if kl is None:
            shared = node.kshare
            if shared is not None:  # the edge is the tail of a donated list: cut it out now
                kl = node.klist = shared[node.kshare_from :]
                node.kshare = None
                return kl
            key = node.key
            assert key is not None, "a node keeps at least one form of its key"
            kl = node.klist = decode_tokens(key)
        return kl

    def _kbytes(self, node: TreeNode) -> bytes:
        kb = node.key
        if kb is None:
            kl = self._klist(node)
            kb = node.key = _pack(f"{len(kl)}i", *kl)
        return kb

    def _page_key(self, src: Any, is_bytes: bool, off: int) -> Any:
        """SGLang's child key of the page starting at key element ``off`` of ``src``: the token
        at page size 1 without bigrams, else the tuple of the tokens the page covers."""
        if is_bytes:
            if self._simple_ck:
                return self._first_struct.unpack_from(src, off * 4)[0]
            return self._ck_struct.unpack_from(src, off * 4)
        if self._simple_ck:
            return src[off]
        return tuple(src[off : off + self._ck_len])

    def _node_page_key(self, node: TreeNode) -> Any:
        """SGLang's child key of ``node``'s own edge (without the root namespace)."""
        if node.klist is not None:
            return self._page_key(node.klist, False, 0)
        if node.kshare is not None:
            return self._page_key(node.kshare, False, node.kshare_from)
        return self._page_key(node.key, True, 0)

    def _node_first_token(self, node: TreeNode) -> int:
        """The first token of ``node``'s edge."""
        if node.klist is not None:
            return node.klist[0]
        if node.kshare is not None:
            return node.kshare[node.kshare_from]
        return self._first_struct.unpack_from(self._kbytes(node), 0)[0]

    def _child_key(self, parent: TreeNode, node: TreeNode) -> Any:
        """The key ``node`` is filed under in ``parent.children`` (see ``TreeNode``): its
        namespaced page key under the root when it has an ``extra_key``, else its first token,
        or its page key when that token is in ``parent.clash``."""
        if parent is self.root and node.extra_key is not None:
            return (node.extra_key, self._node_page_key(node))
        tok = self._node_first_token(node)
        if parent.clash is not None and tok in parent.clash:
            return self._node_page_key(node)
        return tok

    # ------------------------------------------------------------------ events

    def _hash_pages(self, node: TreeNode) -> int | None:
        """Compute and store ``node.hashes`` (its pages' chained hashes, from its parent's last);
        returns the parent's last hash (None below the root)."""
        ps = self.page_size
        parent = node.parent
        hasher = self._hasher
        if parent is self.root:
            parent_hash = None
        else:
            assert parent.hashes is not None, "with events on, every node has its page hashes"
            parent_hash = parent.hashes[-1]
        if type(hasher) is PageHasher:  # the default: the packed key, no token list
            prior = hasher.root(node.extra_key) if parent_hash is None else PageHasher.as_bytes(parent_hash)
            node.hashes = hasher.chain(prior, self._kbytes(node), self._ck_len * 4, ps * 4, node.klen // ps)
        else:
            node.hashes = hasher.page_hashes(parent_hash, node.token_ids()[: node.klen], ps, node.extra_key)
        return parent_hash

    def _emit_stored(self, leaf: TreeNode) -> None:
        parent_hash = self._hash_pages(leaf)
        assert self._events is not None and leaf.hashes is not None
        self._events.emit(
            BlockStored(
                block_hashes=list(leaf.hashes),
                parent_block_hash=parent_hash,
                token_ids=leaf.token_ids(),
                block_size=self.page_size,
                extra_key=leaf.extra_key,
            )
        )

    def stored_event(self, node: TreeNode, medium: str) -> BlockStored:
        """The ``BlockStored`` of ``node``'s pages (its hashes, computed when it was created) in
        ``medium`` ("device", "host", "storage"); for components that report another tier."""
        if node.hashes is None:  # host-only leaves a storage prefetch made: hashed top-down
            chain = []
            n = node
            while n is not self.root and n.hashes is None:
                chain.append(n)
                n = n.parent
            for n in reversed(chain):
                self._hash_pages(n)
        parent = node.parent
        parent_hash = None if parent is self.root or not parent.hashes else parent.hashes[-1]
        return BlockStored(
            block_hashes=list(node.hashes or ()),
            parent_block_hash=parent_hash,
            token_ids=node.token_ids(),
            block_size=self.page_size,
            extra_key=node.extra_key,
            medium=medium,
        )

    def emit_event(self, event: KVEvent) -> None:
        """Emit ``event`` to the tree's sink (a component's tier event); nothing while events are off."""
        if self._events is not None:
            self._events.emit(event)

    def start_events(self, sink: EventSink | None = None, hasher: BlockHasher | None = None) -> None:
        """Turn KV events on (to ``sink``, else queued for ``take_events``), the pages hashed by
        ``hasher`` (default: the tree's ``PageHasher`` of ``hash_seed``), before anything is
        cached: node hashes are computed when nodes are made.

        Raises ValueError (nothing changed) when the tree already holds a node.
        """
        if self.root.children:
            raise ValueError("start_events: the tree already caches prefixes; turn events on before serving")
        self._events = EventQueue(sink)
        self.enable_kv_cache_events = True
        if hasher is not None:
            self._hasher = hasher

    @property
    def block_hasher(self) -> BlockHasher:
        """The hash the tree's events carry (``PageHasher`` of ``hash_seed`` unless given)."""
        return self._hasher

    def take_events(self) -> list:
        """Drain queued KV events (those not delivered to a sink)."""
        return self._events.take() if self._events is not None else []

    # ------------------------------------------------------------------ sizes

    def evictable_size(self, component: str = "full") -> int:
        """Unlocked cached units of ``component`` (FULL: device tokens in unlocked nodes; O(1))."""
        if component == "full":
            return self._evictable
        return self.component(component).sizes().evictable

    def protected_size(self, component: str = "full") -> int:
        """Locked cached units of ``component`` (FULL: device tokens in locked nodes; O(1))."""
        if component == "full":
            return self._protected
        return self.component(component).sizes().protected

    def total_size(self, component: str = "full") -> int:
        """Cached units of ``component``; ``evictable_size() + protected_size()`` (O(1))."""
        if component == "full":
            return self._evictable + self._protected
        return self.component(component).sizes().total

    def sizes(self) -> dict[str, ComponentSizes]:
        """Every component's sizes, by name (FULL first)."""
        return {c.name: c.sizes() for c in self.components}

    # ------------------------------------------------------------------ whole-tree views

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node below the root (DFS, pre-order)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def nodes(self) -> Iterator[TreeNode]:
        """Every node below the root, host-only ones included (DFS, pre-order)."""
        return self._nodes()

    @property
    def evictable_leaves(self) -> Set[TreeNode]:
        """FULL's current eviction candidates, live (unlocked device leaves: no device child).
        Read only; it changes with the tree, so copy it before changing the tree while iterating."""
        return self._leaves

    def eviction_candidates(self) -> list[TreeNode]:
        """A snapshot of :attr:`evictable_leaves`."""
        return list(self._leaves)

    def eviction_queue_size(self) -> int:
        """Entries in FULL's lazy eviction heap plus queued pushes (bounded by a constant times
        the candidates; see ``eviction_heap.py``)."""
        return self._evq.queue_size()

    def all_values_flatten(self) -> np.ndarray:
        """Every cached device slot id (int32), in DFS order."""
        vals = [n.value for n in self._nodes() if n.value is not None]
        return np.concatenate(vals) if vals else np.empty(0, dtype=INT32)

    def path_slots(self, node: TreeNode, upto: int | None = None) -> np.ndarray:
        """The device slot ids of the root path down to ``node`` (int32, root first), the first
        ``upto`` of them when given: what a match ending at ``node`` returns as ``indices``.
        O(depth). Raises ValueError for a node not in this tree or a path through a host-only
        node (it has no device slots)."""
        if not self.owns(node):
            raise ValueError(f"path_slots: {node!r} is not a node of this tree")
        parts = []
        root = self.root
        n = node
        while n is not root:
            if upto is None or n.depth - n.klen < upto:
                if n.value is None:
                    raise ValueError(f"path_slots: node {n.id} on the path has no device slots (host-only)")
                parts.append(n.value)
            n = n.parent
        if not parts:
            return np.empty(0, INT32)
        out = np.concatenate(parts[::-1])
        return out if upto is None else out[:upto]

    def pretty_print(self) -> str:
        """The tree as indented text: per node its length, first tokens, lock count, residency."""
        lines = []
        stack = [(c, 1) for c in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            toks = node.edge()[:10]
            more = "..." if node.klen + self._ex > 10 else ""
            ek = "" if node.extra_key is None or node.parent is not self.root else f" extra_key={node.extra_key!r}"
            res = "" if node.residency == DEVICE else f" {RESIDENCY_NAMES[node.residency]}"
            comp = "" if not node.comp else f" comp={sorted(node.comp)}"
            lines.append(f"{'  ' * depth}[{node.klen}] {toks}{more} lock_ref={node.lock_ref}{ek}{res}{comp}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        lines.append(f"#tokens: {self.total_size()} (evictable {self._evictable}, protected {self._protected})")
        return "\n".join(lines)
