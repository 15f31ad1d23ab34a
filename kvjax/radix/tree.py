"""The radix tree core: one pure-Python tree of page-granular edges (see keys.py for how keys
are represented and why).

This module owns structure and accounting; presets (``RadixCache``) add the public contract,
input checks and the request lifecycle. Components (``component.py``) attach further state.

Costs (n = key elements of the call, d = depth of the path, L = evictable leaves):
  * match / insert from the root: per node on the path, one dict lookup and one C-level compare
    of that node's edge (a list slice compare, or a memcmp for numpy inputs packed once). No
    Python loop over tokens; the request is never copied or re-sliced as a whole.
  * resumed insert (request lifecycle): O(new tokens + nodes below the resume point); nothing
    proportional to the already-cached prefix is copied or compared.
  * lock / unlock: O(d). evict: O(k log L) for k evicted nodes, plus the heap pushes queued
    since the last eviction for leaves that are still evictable (a persistent heap, see
    ``eviction.py``), never a rebuild over all leaves per call.
  * below the root (and for the default namespace at the root) a list walk finds a child by
    its first token (``TreeNode.first``), not by building and hashing a page tuple.
  * sizes: O(1) counters with ``evictable + protected == total``, per component.

Components (``component.py``) plug further kinds of state into the same tree; with none the
hot paths call no hook. Host-only nodes (a component kept a node whose device copy was evicted)
are handled off the fast paths too: the walks check for them only while some exist.
"""

from __future__ import annotations

import heapq
import struct
import sys
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from kvjax.errors import ConfigError
from kvjax.radix.component import ComponentSizes, FullKVComponent, TreeComponent
from kvjax.radix.events import AllBlocksCleared, BlockRemoved, BlockStored, EventQueue, EventSink, PageHasher
from kvjax.radix.eviction import EvictionPolicy, get_eviction_policy, priority_function
from kvjax.radix.keys import INT32, decode_tokens
from kvjax.radix.lock import LockError, LockReceipt
from kvjax.radix.node import DELETED, DEVICE, HOST_ONLY, RESIDENCY_NAMES, TreeNode
from kvjax.radix.stats import CacheStats

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol

_pack = struct.pack
# ``heap_seq`` of a node queued for a heap push (see ``_defer_push``); -1: no entry.
_PENDING = -2
# ``node.first`` value for a first token that several children's edges begin with: the walk
# then looks the child up by its full child key.
_SHARED_FIRST = object()
# SGLang clamps the prompt re-insert's ``priority + 1`` to int64.
_PRIORITY_MAX = 2**63 - 1


class TreeInvariantError(RuntimeError):
    """``sanity_check`` found the tree inconsistent (a bug, never bad input)."""


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class RadixTree:
    """The tree core. See ``RadixCache`` for the public, checked API.

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
        # A child key covers the first page's tokens (one more token for bigram pages); for
        # page size 1 without bigrams it is the bare first token, as in SGLang.
        self._ck_len = self.page_size + self._ex
        self._simple_ck = self._ck_len == 1
        # Tuple child keys cost ~175 ns to build and hash per lookup (16-token pages); walks
        # of list keys find children by first token instead (see ``TreeNode.first``).
        self._by_first = not self._simple_ck
        self._ck_struct = struct.Struct(f"{self._ck_len}i")
        self.policy = get_eviction_policy(eviction_policy, **(eviction_policy_config or {}))
        self.eviction_policy = self.policy.name
        self._prio = priority_function(self.policy)
        self._eager = not self.policy.monotone
        self._full = FullKVComponent(allocator)
        self._full.attach(self)
        self._extra: tuple[TreeComponent, ...] = tuple(components)
        names = [self._full.name] + [c.name for c in self._extra]
        if len(set(names)) != len(names):
            raise ConfigError("components", names, "give every component a unique name ('full' is FULL's)")
        for c in self._extra:
            c.attach(self)
        self.components: tuple[TreeComponent, ...] = (self._full, *self._extra)
        self._by_name: dict[str, TreeComponent] = {c.name: c for c in self.components}
        # Per-component counts of what an ``evict({...})`` call freed by cascade (None outside).
        self._tracker: dict[str, int] | None = None
        events_on = bool(enable_kv_cache_events) or event_sink is not None
        self.enable_kv_cache_events = events_on
        self._events: EventQueue | None = EventQueue(event_sink) if events_on else None
        self._hasher = PageHasher(hash_seed)
        self.hash_seed = hash_seed  # the page hashes' seed (events, a storage tier's keys)
        self.stats = CacheStats()
        # Measurement switch: every match walks (and splits) as usual but reports no hit.
        self.force_miss = False
        self._sim_next = self.page_size  # synthesized slot ids (simulation inserts) skip page 0
        # A list edge ``_common`` cut for the split that follows it (see ``_cut_confirms``).
        self._cut_node: TreeNode | None = None
        self._cut_tail: list | None = None
        self._clear()

    # ------------------------------------------------------------------ state

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
        self._evictable = 0
        self._protected = 0
        self._leaves: set[TreeNode] = set()
        self._heap: list = []
        self._pending: list[TreeNode] = []
        self._seq = 0
        self._host_only = 0  # nodes in the tree without a device copy

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

    # ------------------------------------------------------------------ heap
    #
    # A leaf that becomes evictable (or, under a non-monotone policy, is touched) is queued in
    # ``_pending`` and pushed into the heap only when an eviction needs the heap. Most leaves
    # of a growing cache get a child or a lock before that and are then never pushed at all:
    # a list append instead of a heap push, ~0.5 µs per insert measured on the multi-turn
    # benchmark. The pushed priority is the one the node has at the flush, which is at least
    # as recent as the one an immediate push would have recorded, so the heap stays exact.

    def _defer_push(self, node: TreeNode) -> None:
        """Queue ``node`` for a (re-)push; its older heap entry, if any, is dead from now on."""
        node.heap_seq = _PENDING
        pending = self._pending
        pending.append(node)
        if len(pending) > 2 * len(self._leaves) + 1024:
            self._flush_pushes()  # bounds the queue on trees that never evict

    def _flush_pushes(self) -> None:
        """Push every queued node that is still an evictable leaf (once each)."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        leaves = self._leaves
        heap = self._heap
        prio = self._prio
        heappush = heapq.heappush
        seq = self._seq
        for node in pending:
            if node.heap_seq == _PENDING and node in leaves:
                seq += 1
                node.heap_seq = seq
                heappush(heap, (prio(node), seq, node))  # inlined _push
        self._seq = seq
        if len(self._heap) > 4 * len(leaves) + 1024:
            self._compact_heap()

    def _push(self, node: TreeNode) -> None:
        self._seq += 1
        node.heap_seq = self._seq
        heapq.heappush(self._heap, (self._prio(node), self._seq, node))

    def _compact_heap(self) -> None:
        """Drop dead entries: rebuild the heap from the evictable leaves (O(L))."""
        heap = []
        prio = self._prio
        for node in self._leaves:
            self._seq += 1
            node.heap_seq = self._seq
            heap.append((prio(node), self._seq, node))
        heapq.heapify(heap)
        self._heap = heap
        self._pending = []

    # ------------------------------------------------------------------ walking
    #
    # A request is walked in one of two forms: a list of ints (``is_bytes`` False; lists are
    # never copied, only one edge's window is sliced per node) or native int32 bytes (numpy
    # inputs, packed once for free). Each node keeps the matching form of its edge.

    def _klist(self, node: TreeNode) -> list:
        kl = node.klist
        if kl is None:
            key = node.key
            assert key is not None, "a node keeps at least one form of its key"
            kl = node.klist = decode_tokens(key)
        return kl

    def _kbytes(self, node: TreeNode) -> bytes:
        kb = node.key
        if kb is None:
            kl = node.klist
            assert kl is not None, "a node keeps at least one form of its key"
            kb = node.key = _pack(f"{len(kl)}i", *kl)
        return kb

    def _child_key(self, src: Any, is_bytes: bool, off: int) -> Any:
        """SGLang's child key of the page starting at key element ``off`` of ``src``."""
        if is_bytes:
            if self._simple_ck:
                return self._ck_struct.unpack_from(src, off * 4)[0]
            return self._ck_struct.unpack_from(src, off * 4)
        if self._simple_ck:
            return src[off]
        return tuple(src[off : off + self._ck_len])

    def _node_child_key(self, node: TreeNode) -> Any:
        """The child key of ``node``'s own edge (without the root namespace)."""
        if node.klist is not None:
            return self._child_key(node.klist, False, 0)
        return self._child_key(node.key, True, 0)

    def _find_child(self, node: TreeNode, src: Any, is_bytes: bool, off: int, extra_key: Hashable) -> TreeNode | None:
        """The child of ``node`` whose edge may continue ``src`` at element ``off``.

        Exact (the child keyed by the page at ``off``) except for list sources in a tree with
        tuple child keys (outside a root namespace), where it is the only child whose edge
        starts with ``src[off]``: its first page may still differ, which the caller's edge
        compare finds (a match of 0).
        """
        namespaced = extra_key is not None and node is self.root
        if is_bytes or self._simple_ck or namespaced:
            ck = self._child_key(src, is_bytes, off)
            return node.children.get((extra_key, ck) if namespaced else ck)
        idx = node.first
        child = idx.get(src[off]) if idx is not None else None
        if child is _SHARED_FIRST:
            child = node.children.get(tuple(src[off : off + self._ck_len]))
        return child

    def _common(self, node: TreeNode, src: Any, is_bytes: bool, off: int, lim: int) -> int:
        """Page-aligned count of leading key elements shared by ``node``'s edge and ``src``
        from element ``off``, at most ``lim`` (itself page-aligned).

        Callers split ``node`` at a non-zero result right away: for list keys without bigrams
        this may already have cut the edge's list there (its confirming compare then reads the
        request's window against the list itself, not against a copy of the list's head), and
        :meth:`_split` completes that cut.
        """
        ex = self._ex
        nt = lim + ex  # tokens covered by lim key elements
        if is_bytes:
            kb = self._kbytes(node)
            b = off * 4
            if src[b : b + nt * 4] == kb[: nt * 4]:
                return lim
            a1 = np.frombuffer(src, dtype=INT32, count=nt, offset=b)
            a2 = np.frombuffer(kb, dtype=INT32, count=nt)
            first = int(np.argmax(a1 != a2))  # first differing token; one exists here
        else:
            kl = self._klist(node)
            lo, hi = 0, nt  # the slice bisect below: [0, lo) equal, a difference in [lo, hi)
            last = nt - 1
            if src[off + last] == kl[last]:
                # Probably the whole window (a query that is a prefix of the edge): one compare.
                if nt == len(kl) or ex:
                    if src[off : off + nt] == (kl if nt == len(kl) else kl[:nt]):
                        return lim
                elif self._cut_confirms(node, kl, src, off, nt):
                    return lim
            else:
                # A difference at the end: guess where the shared part ends by bisecting single
                # elements (tokens past a shared prefix rarely agree), then confirm the guess
                # with one slice compare. Each slice costs ~2 ns per element (references are
                # taken and dropped), a probe ~40 ns, so this reads ~first elements where the
                # plain bisect reads ~4 * nt. A wrong guess only narrows the bisect below.
                a, b = 0, last  # element b differs
                while a < b:
                    mid = (a + b) >> 1
                    if src[off + mid] == kl[mid]:
                        a = mid + 1
                    else:
                        b = mid
                if a == 0:
                    lo = hi = 0
                elif not ex and a % self.page_size == 0:
                    if self._cut_confirms(node, kl, src, off, a):
                        return a  # elements [0, a) equal and element a differs: the answer
                    hi = a
                elif src[off : off + a] == kl[:a]:
                    lo = hi = a  # elements [0, a) equal and element a differs: the answer
                else:
                    hi = a
            # Bisect with C-level slice compares (~2 * nt element compares in all), then scan.
            while hi - lo > 8:
                mid = (lo + hi) >> 1
                if src[off + lo : off + mid] == kl[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            while lo < hi and src[off + lo] == kl[lo]:
                lo += 1
            first = lo
        k = first - ex  # element i needs tokens i .. i + ex to match
        if k < 0:
            k = 0
        return k - k % self.page_size

    def _cut_confirms(self, node: TreeNode, kl: list, src: list, off: int, k: int) -> bool:
        """Whether ``src[off:off + k]`` equals the first ``k`` tokens of ``node``'s list ``kl``
        (no bigrams, ``0 < k < len(kl)``), compared as a split at ``k`` needs them: the tail is
        cut off ``kl`` first, so only the request's window is copied. When equal, the cut stays
        for the caller's :meth:`_split` at ``k``; otherwise ``kl`` is restored."""
        tail = kl[k:]
        del kl[k:]
        if src[off : off + k] == kl:
            self._cut_node = node
            self._cut_tail = tail
            return True
        kl += tail
        return False

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child`` after ``k`` key elements; returns the new parent holding them.

        Sizes do not change (tokens move between two nodes with the same lock count), the
        new parent inherits lock_ref, priority, hit_count and residency, and page hashes are cut
        at the page boundary so they stay what they were. Components redistribute their data
        in ``on_split``.
        """
        ex = self._ex
        self._clock += 1
        parent = child.parent
        kl = child.klist
        if kl is not None:
            # The upper part keeps the list, cut in place: only the lower part is copied (a
            # node's list is its own, never handed out; ``token_ids`` returns copies).
            if self._cut_node is child:  # ``_common`` already cut it at k
                child.klist = self._cut_tail
                self._cut_node = self._cut_tail = None
            else:
                child.klist = kl[k:]
                del kl[k + ex :]
        kb = child.key
        if kb is not None:
            child.key = kb[k * 4 :]
            kb = kb[: (k + ex) * 4]
        cv = child.value
        new = TreeNode(
            self._owner,
            self._clock,
            parent,
            kl,
            kb,
            k,
            child.depth - child.klen + k,
            None if cv is None else cv[:k],
            child.priority,
            child.hit_count,
            child.extra_key,
        )
        if cv is not None:
            child.value = cv[k:]
        else:  # a host-only node: both parts stay host-only
            new.residency = HOST_ONLY
            self._host_only += 1
        new.lock_ref = child.lock_ref
        pck = new.ckey = child.ckey
        parent.children[pck] = new
        child.klen -= k
        # The lower part's child key (``_node_child_key``, inlined).
        lower = child.klist
        if lower is not None:
            ck = lower[0] if self._simple_ck else tuple(lower[: self._ck_len])
        else:
            ck = self._child_key(child.key, True, 0)
        child.ckey = ck
        child.parent = new
        new.children = {ck: child}
        if self._by_first:
            idx = parent.first
            if (parent is not self.root or new.extra_key is None) and idx is not None and idx.get(pck[0]) is child:
                idx[pck[0]] = new
            new.first = {ck[0]: child}
        if child.hashes is not None:
            p = k // self.page_size
            new.hashes = child.hashes[:p]
            child.hashes = child.hashes[p:]
        if self._eager and child in self._leaves:
            self._defer_push(child)  # it was just touched: a non-monotone priority moved
        for c in self._extra:
            c.on_split(new, child, k)
        return new

    def _match_walk(self, src: Any, is_bytes: bool, n: int, extra_key: Hashable, t: int) -> tuple[TreeNode, int, list]:
        """Longest cached prefix of key elements ``[0, n)`` of ``src`` (n page-aligned).

        Splits the last node if the match ends inside it (the part below the cut gets time
        ``t``, as SGLang's split stamps it). Without components it also touches the nodes on the
        path with time ``t``; with components the caller touches from where the match finally
        ends (:meth:`touch_to_root`), after they may have shortened it. Returns
        ``(last node, matched elements, list of value arrays)``.
        """
        touch = not self._extra
        node = self.root
        off = 0
        vals: list = []
        ex = self._ex
        simple = self._simple_ck
        ckl = self._ck_len
        if extra_key is None and not is_bytes and not simple:
            idx = node.first  # inlined _find_child for the common case (a call costs ~0.3 µs)
            child = idx.get(src[0]) if idx is not None else None
            if child is _SHARED_FIRST:
                child = node.children.get(tuple(src[:ckl]))
        elif extra_key is None and not is_bytes:
            child = node.children.get(src[0])  # inlined _find_child: page size 1, list input
        else:
            child = self._find_child(node, src, is_bytes, 0, extra_key)
        while child is not None:
            m = child.klen
            rem = n - off
            if m <= rem and (
                src[off * 4 : (off + m + ex) * 4] == (child.key if child.key is not None else self._kbytes(child))
                if is_bytes
                else src[off : off + m + ex] == (child.klist if child.klist is not None else self._klist(child))
            ):
                if touch:
                    child.last_access = t
                vals.append(child.value)
                off += m
                node = child
                if off >= n:
                    break
                # Inlined _find_child below the root (one call per node costs ~80 ns).
                if is_bytes:
                    child = node.children.get(self._child_key(src, True, off))
                elif simple:
                    child = node.children.get(src[off])
                else:
                    idx = node.first
                    child = idx.get(src[off]) if idx is not None else None
                    if child is _SHARED_FIRST:
                        child = node.children.get(tuple(src[off : off + ckl]))
                continue
            k = self._common(child, src, is_bytes, off, m if m < rem else rem)
            if k:
                child.last_access = t  # the part below the cut keeps the touch
                node = self._split(child, k)
                vals.append(node.value)
                off += k
            # k == 0: a first-token candidate whose first page differs; nothing matches here.
            break
        return node, off, vals

    def _insert_walk(
        self,
        start: TreeNode,
        src: Any,
        is_bytes: bool,
        n: int,
        values: np.ndarray | None,
        extra_key: Hashable,
        priority: int,
        t: int,
        hit_from: int,
        collect: bool,
        payloads: Mapping[str, Any] | None = None,
    ) -> tuple[TreeNode, int, list | None]:
        """Insert key elements ``[0, n)`` of ``src`` below ``start``, whose path must be the
        prefix of the key that precedes ``src``.

        ``values[i]`` is the slot of element ``i`` (None: synthesize ids, simulation only).
        A node on the path counts one hit when its end depth (from the root) exceeds
        ``hit_from`` (SGLang 0.5.23's ``inserted_len``: a request counts each node once). A
        host-only node on the path becomes device-resident from the incoming slots and counts
        as already cached. ``payloads`` are the components' insert payloads, by name.
        Returns ``(node covering element n - 1, elements already cached, value arrays of the
        cached part if collect)``.
        """
        node = start
        off = 0
        vals: list = []
        ex = self._ex
        simple = self._simple_ck
        ckl = self._ck_len
        extra = self._extra
        slow = bool(extra) or self._host_only > 0
        if extra_key is None and not is_bytes and not simple:
            idx = node.first  # inlined _find_child for the common case (a call costs ~0.3 µs)
            child = idx.get(src[0]) if idx is not None else None
            if child is _SHARED_FIRST:
                child = node.children.get(tuple(src[:ckl]))
        elif extra_key is None and not is_bytes:
            child = node.children.get(src[0])  # inlined _find_child: page size 1, list input
        else:
            child = self._find_child(node, src, is_bytes, 0, extra_key)
        while child is not None:
            m = child.klen
            rem = n - off
            if m <= rem and (
                src[off * 4 : (off + m + ex) * 4] == (child.key if child.key is not None else self._kbytes(child))
                if is_bytes
                else src[off : off + m + ex] == (child.klist if child.klist is not None else self._klist(child))
            ):
                child.last_access = t
                k = m
            else:
                k = self._common(child, src, is_bytes, off, m if m < rem else rem)
                if not k:
                    break  # a first-token candidate whose first page differs
                child.last_access = t  # the part below the cut keeps the touch
                child = self._split(child, k)
            if priority > child.priority:
                child.priority = priority
            if child.depth > hit_from:
                child.hit_count += 1
            if slow:  # host-only nodes exist or components listen: off the full-KV-only path
                self._overlap(node, child, values, off, k, payloads)
                if collect and child.parent is not node:
                    # A component split the node (an SWA window edge): the upper parts come first.
                    upper = []
                    u = child.parent
                    while u is not node:
                        upper.append(u.value)
                        u = u.parent
                    vals.extend(reversed(upper))
            if collect:
                vals.append(child.value)
            off += k
            node = child
            if off >= n:
                break
            # Inlined _find_child below the root (one call per node costs ~80 ns).
            if is_bytes:
                child = node.children.get(self._child_key(src, True, off))
            elif simple:
                child = node.children.get(src[off])
            else:
                idx = node.first
                child = idx.get(src[off]) if idx is not None else None
                if child is _SHARED_FIRST:
                    child = node.children.get(tuple(src[off : off + ckl]))
        if off >= n:
            if self._eager and node in self._leaves:
                self._defer_push(node)
            return node, off, vals if collect else None
        # Unmatched remainder: one new leaf.
        klen = n - off
        if values is None:
            v = np.arange(self._sim_next, self._sim_next + klen, dtype=INT32)
            self._sim_next += klen
        else:
            v = values[off:n].copy()  # owned copy: callers reuse their rows
        self._clock += 1
        depth = node.depth + klen
        if is_bytes:
            leaf = TreeNode(
                self._owner,
                self._clock,
                node,
                None,
                src[off * 4 : (n + ex) * 4],
                klen,
                depth,
                v,
                priority,
                1 if depth > hit_from else 0,
                extra_key,
            )
            ck = self._child_key(src, True, off)
        else:
            kl = src[off : n + ex]
            leaf = TreeNode(
                self._owner,
                self._clock,
                node,
                kl,
                None,
                klen,
                depth,
                v,
                priority,
                1 if depth > hit_from else 0,
                extra_key,
            )
            ck = kl[0] if simple else tuple(kl[:ckl])
        if node is self.root and extra_key is not None:
            ck = (extra_key, ck)
        leaf.ckey = ck
        node.children[ck] = leaf
        if self._by_first and (node is not self.root or extra_key is None):
            idx = node.first
            if idx is None:
                node.first = {ck[0]: leaf}
            else:
                # A second child with this first token: walks fall back to the full key.
                c0 = ck[0]
                idx[c0] = _SHARED_FIRST if c0 in idx else leaf
        self._evictable += klen
        leaves = self._leaves
        leaves.discard(node)  # it has a child now
        leaves.add(leaf)
        leaf.heap_seq = _PENDING  # inlined _defer_push
        pending = self._pending
        pending.append(leaf)
        if len(pending) > 2 * len(leaves) + 1024:
            self._flush_pushes()
        self.stats.inserted_tokens += klen
        if self._events is not None:
            self._emit_stored(leaf)
        if extra:
            for c in extra:
                c.on_new_node(leaf, payloads.get(c.name) if payloads else None)
        return leaf, off, vals if collect else None

    def _overlap(
        self,
        parent: TreeNode,
        node: TreeNode,
        values: np.ndarray | None,
        off: int,
        k: int,
        payloads: Mapping[str, Any] | None,
    ) -> None:
        """An insert walked over ``node`` (``k`` elements from ``off``): revive it if host-only,
        then the components' ``on_insert_overlap``."""
        revived = False
        if node.value is None:
            self._revive(parent, node, values, off, k)
            revived = True
        for c in self._extra:
            c.on_insert_overlap(node, payloads.get(c.name) if payloads else None, revived)

    def _revive(self, parent: TreeNode, node: TreeNode, values: np.ndarray | None, off: int, k: int) -> None:
        """Make the host-only ``node`` (``k`` key elements, ``values[off:off + k]`` incoming)
        device-resident again, keeping what components hold on it (a host copy)."""
        if values is None:
            v = np.arange(self._sim_next, self._sim_next + k, dtype=INT32)
            self._sim_next += k
        else:
            v = values[off : off + k].copy()
        node.value = v
        node.residency = DEVICE
        self._host_only -= 1
        self._evictable += k  # host-only nodes are never locked
        leaves = self._leaves
        leaves.discard(parent)  # it has a device child now
        if node.lock_ref == 0 and not self._has_device_child(node):
            leaves.add(node)
            self._defer_push(node)
        if self._events is not None:
            self._emit_stored(node)

    def touch_to_root(self, node: TreeNode, t: int) -> None:
        """Access time ``t`` for ``node`` and its ancestors: a match's recency refresh, from the
        node where it finally ends (SGLang 0.5.23's ``_match_post_processor``), never for deeper
        nodes its walk passed. O(depth)."""
        root = self.root
        while node is not root:
            node.last_access = t
            node = node.parent

    def _has_device_child(self, node: TreeNode) -> bool:
        """Whether ``node`` has a device-resident child (any child, while no node is host-only)."""
        if not self._host_only:
            return bool(node.children)
        return any(c.value is not None for c in node.children.values())

    def _touch_path(
        self, node: TreeNode, t: int, priority: int, hit_from: int, prompt_len: int = -1, t_prompt: int = 0
    ) -> None:
        """Give ``node`` and its ancestors what an insert from the root would: access time
        ``t``, max priority, one hit on each node whose end depth exceeds ``hit_from``. Nodes
        ending at or above ``prompt_len`` also get what SGLang 0.5.23's prompt re-insert gives
        them: time ``t_prompt`` and priority ``priority + 1``. O(depth), no token work."""
        root = self.root
        if self._eager and node in self._leaves:
            node.last_access = t
            self._defer_push(node)
        prompt_priority = priority + 1 if priority < _PRIORITY_MAX else priority
        while node is not root:
            if node.depth <= prompt_len:
                node.last_access = t_prompt
                if prompt_priority > node.priority:
                    node.priority = prompt_priority
            else:
                node.last_access = t
                if priority > node.priority:
                    node.priority = priority
            if node.depth > hit_from:
                node.hit_count += 1
            node = node.parent

    # ------------------------------------------------------------------ events

    def _emit_stored(self, leaf: TreeNode) -> None:
        ps = self.page_size
        parent = leaf.parent
        if parent is self.root:
            prior = self._hasher.root(leaf.extra_key)
            parent_hash = None
        else:
            assert parent.hashes is not None, "with events on, every node has its page hashes"
            parent_hash = parent.hashes[-1]
            prior = PageHasher.as_bytes(parent_hash)
        kb = self._kbytes(leaf)
        leaf.hashes = self._hasher.chain(prior, kb, self._ck_len * 4, ps * 4, leaf.klen // ps)
        assert self._events is not None
        self._events.emit(
            BlockStored(
                block_hashes=list(leaf.hashes),
                parent_block_hash=parent_hash,
                token_ids=leaf.token_ids(),
                block_size=ps,
                extra_key=leaf.extra_key,
            )
        )

    def take_events(self) -> list:
        """Drain queued KV events (those not delivered to a sink)."""
        return self._events.take() if self._events is not None else []

    # ------------------------------------------------------------------ locks

    def _check_node(self, node: Any, what: str) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{what}: expected a TreeNode or LockReceipt, got {type(node).__name__}")
        if node.owner is not self._owner:
            raise LockError(f"{what}: node {node.id} does not belong to this tree (another tree, or before reset())")
        if node.residency == HOST_ONLY:
            raise LockError(
                f"{what}: node {node.id} is host-only (its device copy was evicted); "
                "lock a device-resident node (the match's last_node), or bring it back first"
            )
        if node.value is None:
            raise LockError(f"{what}: node {node.id} was evicted; lock a node before it can be evicted")

    def inc_lock_ref(self, node: Any) -> LockReceipt:
        """Lock ``node`` and every ancestor (the node itself included) against eviction.

        FULL's scope is the path to the root: each node whose lock count goes 0 -> 1 moves its
        tokens from evictable to protected. Each component then locks its own scope and its
        part goes into the receipt. Returns a receipt for ``dec_lock_ref`` (its ``delta`` is
        SGLang's return value, FULL tokens). Raises :class:`LockError` for a host-only, evicted
        or foreign node.
        """
        root = self.root
        if node is None or node is root:
            return LockReceipt(node, 0, None, self._owner)
        if type(node) is not TreeNode or node.owner is not self._owner or node.value is None:
            self._check_node(node, "inc_lock_ref")  # raises the precise error
        leaves = self._leaves
        delta = 0
        n = node
        while n is not root:
            if n.lock_ref == 0:
                delta -= n.klen
                leaves.discard(n)
            n.lock_ref += 1
            n = n.parent
        self._evictable += delta
        self._protected -= delta
        parts = tuple(c.lock(node) for c in self._extra) if self._extra else None
        return LockReceipt(node, delta, parts, self._owner)

    def dec_lock_ref(self, node_or_receipt: Any) -> int:
        """Release a lock taken by ``inc_lock_ref`` (pass its receipt, or the node).

        Returns the tokens that became evictable. Raises :class:`LockError` — leaving the
        tree unchanged — for a receipt released twice, a node not locked (unlock below zero),
        an evicted node, or a node of another tree or of a tree generation before ``reset``.
        """
        receipt = None
        parts = None
        x = node_or_receipt
        if isinstance(x, LockReceipt):
            if x.released:
                raise LockError(f"dec_lock_ref: {x!r} was already released")
            if x.node is not None and x.node is not self.root and x.owner is not self._owner:
                raise LockError(f"dec_lock_ref: {x!r} belongs to another tree or to one before reset()")
            receipt, parts, x = x, x.parts, x.node
        root = self.root
        if x is None or x is root:
            if receipt is not None:
                receipt.released = True
            return 0
        if type(x) is not TreeNode or x.owner is not self._owner or x.value is None:
            self._check_node(x, "dec_lock_ref")  # raises the precise error
        # One pass; on an unlock below zero the decrements made so far are undone before
        # raising, so an error leaves every count as it was.
        delta = 0
        n = x
        while n is not root:
            lr = n.lock_ref
            if lr <= 0:
                u = x
                while u is not n:
                    u.lock_ref += 1
                    u = u.parent
                where = "" if n is x else f" (ancestor {n.id} of node {x.id})"
                raise LockError(f"dec_lock_ref: node {n.id}{where} is not locked (lock_ref would go below zero)")
            n.lock_ref = lr - 1
            if lr == 1:
                delta += n.klen
            n = n.parent
        # Only x can become an evictable leaf: every ancestor has x as a device child.
        if x.lock_ref == 0 and (not x.children or (self._host_only and not self._has_device_child(x))):
            self._leaves.add(x)
            self._defer_push(x)
        self._evictable += delta
        self._protected -= delta
        if self._extra:
            for i, c in enumerate(self._extra):
                c.unlock(x, parts[i] if parts else None)
        if receipt is not None:
            receipt.released = True
        return delta

    def _move_lock(self, old: Any, new_node: TreeNode) -> LockReceipt:
        """Move a request's lock from ``old`` (receipt or node) to ``new_node``.

        When the old node is an ancestor-or-self of ``new_node`` (always so in the request
        lifecycle) only the nodes in between are touched: O(new nodes), not O(depth).
        """
        if isinstance(old, LockReceipt):
            if old.released:
                raise LockError(f"the request's lock {old!r} was already released")
            old_node = old.node
        else:
            old_node = old
        if old_node is None:
            old_node = self.root
        if old_node is not self.root:
            self._check_node(old_node, "move lock")
            if old_node.lock_ref <= 0:
                raise LockError(f"the request's last node {old_node.id} is not locked")
        if new_node is old_node:
            if isinstance(old, LockReceipt):
                return old
            return LockReceipt(new_node, 0, None, self._owner)
        if self._extra:
            new = self.inc_lock_ref(new_node)
            self.dec_lock_ref(old)
            return new
        path = []
        root = self.root
        n = new_node
        while n is not old_node and n is not root:
            path.append(n)
            n = n.parent
        if n is not old_node:  # not an ancestor: lock the new path, then release the old one
            new = self.inc_lock_ref(new_node)
            self.dec_lock_ref(old)
            return new
        delta = 0
        leaves = self._leaves
        for n in path:
            if n.lock_ref == 0:
                delta -= n.klen
                leaves.discard(n)
            n.lock_ref += 1
        self._evictable += delta
        self._protected -= delta
        if isinstance(old, LockReceipt):
            old.released = True
        return LockReceipt(new_node, delta, None, self._owner)

    # ------------------------------------------------------------------ eviction

    @overload
    def evict(self, num_tokens: int) -> int: ...

    @overload
    def evict(self, num_tokens: Mapping[str, int]) -> dict[str, int]: ...

    def evict(self, num_tokens: int | Mapping[str, int]) -> int | dict[str, int]:
        """Free cached state until the asked amounts are freed or nothing evictable is left.

        ``evict(n)`` (SGLang's plain ``RadixCache``): FULL eviction of ``n`` tokens; returns
        the tokens evicted. ``evict({"full": n, "swa": m, ...})``: per-component amounts, in
        that component's own units, run in the tree's component order (FULL first); returns
        per-component counts of what was freed, cascades included (every component is listed).
        A component is asked only for what the earlier components' cascades left of its amount.
        May free more than asked (whole nodes). The cascade rules are in ``component.py``.

        Raises (tree unchanged): ValueError for an unknown component name or a negative or
        non-integer amount.
        """
        if type(num_tokens) is int or not isinstance(num_tokens, Mapping):  # an ABC check costs ~1 µs
            return self.evict_full(num_tokens)
        amounts: dict[str, int] = {}
        for name, amount in num_tokens.items():
            if name not in self._by_name:
                raise ValueError(f"evict: no component {name!r}; this tree has {', '.join(self._by_name)}")
            if isinstance(amount, bool) or not isinstance(amount, (int, np.integer)) or amount < 0:
                raise ValueError(f"evict: amount for {name!r} must be an integer >= 0, got {amount!r}")
            amounts[name] = int(amount)
        counts = {c.name: 0 for c in self.components}
        self._tracker = counts
        try:
            for c in self.components:
                # What earlier components' cascades already freed counts toward the amount
                # (SGLang 0.5.23's shared tracker): FULL eviction frees SWA slots too.
                amount = amounts.get(c.name, 0) - counts[c.name]
                if amount > 0:
                    counts[c.name] += c.evict(amount)
        finally:
            self._tracker = None
        return counts

    def evict_full(self, num_tokens: int) -> int:
        """FULL eviction: unlocked device leaves, most evictable first by the policy, until at
        least ``num_tokens`` tokens are freed or none is left.

        Each evicted node's slot ids go to the allocator in one ``free_segment`` (pages in row
        order), node by node in eviction order (as SGLang 0.5.23). A leaf some component keeps (or with host-only
        children) loses its device copy and stays host-only; any other is deleted with every
        component's data on it. Parents that become unlocked device leaves join the
        candidates. Returns the FULL tokens evicted.
        """
        num_tokens = int(num_tokens)
        leaves = self._leaves
        if num_tokens <= 0 or not leaves:
            return 0
        if self._pending:
            self._flush_pushes()
        heap = self._heap
        prio = self._prio
        # Host-only nodes need a component that keeps them: without components, none appear.
        if self._extra or self._host_only > 0:
            return self._evict_generic(num_tokens)
        heappop = heapq.heappop
        heappush = heapq.heappush
        by_first = self._by_first
        root = self.root
        free = self._full.free if self._full.allocator is not None else None
        emit = self._events.emit if self._events is not None else None
        evicted = 0
        num_nodes = 0
        while evicted < num_tokens and heap:
            p, seq, node = heappop(heap)
            if node.heap_seq != seq or node not in leaves:
                continue  # dead entry: node changed state or was re-pushed since
            cur = prio(node)
            if cur != p:  # stale (monotone policies only grow): requeue at its true place
                self._seq = seq = self._seq + 1
                node.heap_seq = seq
                heappush(heap, (cur, seq, node))
                continue
            klen = node.klen
            evicted += klen
            num_nodes += 1
            parent = node.parent
            ck = node.ckey
            del parent.children[ck]
            if by_first and (parent is not root or node.extra_key is None):
                first = parent.first
                c0 = ck[0]
                if first.get(c0) is node:
                    del first[c0]
            leaves.discard(node)
            self._evictable -= klen
            if free is not None:
                free(node.value)
            node.value = None
            node.residency = DELETED
            node.heap_seq = -1
            if emit is not None:
                emit(BlockRemoved(block_hashes=list(node.hashes or ())))
            if parent is not root and parent.lock_ref == 0 and not parent.children:
                leaves.add(parent)
                self._seq = seq = self._seq + 1
                parent.heap_seq = seq
                heappush(heap, (prio(parent), seq, parent))
        self.stats.evicted_tokens += evicted
        self.stats.num_evictions += num_nodes
        return evicted

    def _evict_generic(self, num_tokens: int) -> int:
        """``evict_full`` while components are attached or host-only nodes exist: each
        candidate goes through :meth:`_evict_device_leaf` (demote or delete, cascade)."""
        heap = self._heap
        leaves = self._leaves
        prio = self._prio
        push = self._push
        evicted = 0
        num_nodes = 0
        while evicted < num_tokens and heap:
            p, seq, node = heapq.heappop(heap)
            if node.heap_seq != seq or node not in leaves:
                continue  # dead entry: node changed state or was re-pushed since
            if prio(node) != p:  # stale (monotone policies only grow): requeue at its true place
                push(node)
                continue
            evicted += node.klen
            num_nodes += 1
            self._evict_device_leaf(node)
        self.stats.evicted_tokens += evicted
        self.stats.num_evictions += num_nodes
        return evicted

    def _drop_device_copy(self, node: TreeNode) -> None:
        """Free a device node's slots (FULL) and take it out of FULL's sizes and candidates."""
        self._leaves.discard(node)
        if node.lock_ref:
            raise LockError(f"node {node.id} is locked; a locked node's device copy cannot be dropped")
        self._evictable -= node.klen
        self._full.free(node.value)
        node.value = None
        node.heap_seq = -1
        if self._events is not None:
            self._events.emit(BlockRemoved(block_hashes=list(node.hashes or ())))

    def _evict_device_leaf(self, node: TreeNode) -> None:
        """FULL eviction of one candidate leaf, with components: demote or delete, cascade."""
        parent = node.parent
        # Every component is asked (a host tier backs the node up in ``keeps_node`` under
        # write-back, even when host-only children would keep it anyway).
        kept = [c.keeps_node(node) for c in self._extra]
        keep = bool(node.children) or any(kept)
        self._drop_device_copy(node)
        if keep:
            node.residency = HOST_ONLY
            self._host_only += 1
            tracker = self._tracker
            for c in self._extra:
                freed = c.on_demote(node)
                if tracker is not None and freed:
                    tracker[c.name] += freed
        else:
            self._detach(node)
        self._after_child_change(parent)

    def _detach(self, node: TreeNode) -> None:
        """Take a childless node (device copy already gone) out of the tree; components free
        their data on it (counted as cascade in an ``evict({...})`` call)."""
        parent = node.parent
        del parent.children[node.ckey]
        if self._by_first and (parent is not self.root or node.extra_key is None):
            idx = parent.first
            if idx is not None and idx.get(node.ckey[0]) is node:
                del idx[node.ckey[0]]
        if node.residency == HOST_ONLY:
            self._host_only -= 1
        node.residency = DELETED
        tracker = self._tracker
        for c in self._extra:
            freed = c.on_delete(node)
            if tracker is not None and freed:
                tracker[c.name] += freed

    def _after_child_change(self, parent: TreeNode) -> None:
        """A child of ``parent`` was deleted or demoted: delete childless host-only ancestors no
        component keeps (iteratively), or make a device parent an eviction candidate."""
        root = self.root
        while parent is not root:
            if parent.residency == HOST_ONLY:
                if parent.children or any(c.keeps_node(parent) for c in self._extra):
                    return
                grand = parent.parent
                self._detach(parent)
                parent = grand
                continue
            if parent.lock_ref == 0 and not self._has_device_child(parent) and parent not in self._leaves:
                self._leaves.add(parent)
                self._push(parent)
            return

    def delete_leaf(self, node: TreeNode) -> None:
        """Delete a childless, FULL-unlocked node outright (for components' own eviction: e.g.
        Mamba state eviction on a leaf, SWA eviction of an unlocked leaf).

        Its device slots, if any, are freed (counted as ``full`` in an ``evict({...})`` call),
        every component's ``on_delete`` frees its data (the calling component clears its own
        first), and the ancestors cascade as in FULL eviction.

        Raises (tree unchanged): LockError for a node that is locked, has children, or is not
        in this tree.
        """
        if not isinstance(node, TreeNode) or node.owner is not self._owner or node.residency == DELETED:
            raise LockError(f"delete_leaf: {node!r} is not a node of this tree")
        if node is self.root or node.children or node.lock_ref:
            raise LockError(f"delete_leaf: node {node.id} is the root, has children or is locked")
        parent = node.parent
        if node.value is not None:
            tokens = node.klen
            self._drop_device_copy(node)
            if self._tracker is not None:
                self._tracker[self._full.name] += tokens
            self.stats.evicted_tokens += tokens
            self.stats.num_evictions += 1
        self._detach(node)
        self._after_child_change(parent)

    def synthesize_slots(self, n: int) -> np.ndarray:
        """``n`` fresh slot ids as a simulation insert would synthesize them (a tree without an
        allocator); for components that bring nodes back in simulation."""
        v = np.arange(self._sim_next, self._sim_next + n, dtype=INT32)
        self._sim_next += n
        return v

    def revive_node(self, node: TreeNode, values: np.ndarray) -> None:
        """Make the host-only ``node`` device-resident from ``values`` (its ``klen`` slot ids),
        for a component that brought its data back (a host tier's load-back). Its parent must
        be device-resident (or the root): revive a host-only chain from the top. Calls no
        hook; the component keeps its data on the node.

        Raises (tree unchanged): ValueError for a node that is not host-only in this tree, a
        host-only parent, or a wrong number of slots.
        """
        if not isinstance(node, TreeNode) or node.owner is not self._owner or node.residency != HOST_ONLY:
            raise ValueError(f"revive_node: {node!r} is not a host-only node of this tree")
        parent = node.parent
        if parent is not self.root and parent.residency != DEVICE:
            raise ValueError(f"revive_node: node {node.id}'s parent {parent.id} is host-only; revive it first")
        v = np.asarray(values)
        if v.shape != (node.klen,):
            raise ValueError(f"revive_node: {v.shape} slot ids for node {node.id} of {node.klen} key elements")
        self._revive(parent, node, v.astype(INT32), 0, node.klen)

    def add_host_only_leaf(self, parent: TreeNode, tokens: Sequence[int], extra_key: Hashable = None) -> TreeNode:
        """A new host-only leaf below ``parent`` with edge ``tokens`` (whole pages; one more
        token with bigram keys), for a component that brought the node's data from elsewhere (a
        storage tier's prefetch). ``extra_key``: the namespace (must be ``parent``'s below the
        root). The node holds no slots and no lock; it calls no hook, so the caller must give
        it data that keeps it (a host copy) before anything else runs. Emits no event (a
        host-only node has no device pages; reviving it emits them).

        Raises (tree unchanged): ValueError for a parent not in this tree, a partial page, a
        namespace that differs from the parent's, or a child of ``parent`` with the same first
        page (the pages are in the tree already).
        """
        if not isinstance(parent, TreeNode) or parent.owner is not self._owner or parent.residency == DELETED:
            raise ValueError(f"add_host_only_leaf: {parent!r} is not a node of this tree")
        toks = [int(t) for t in tokens]
        klen = len(toks) - self._ex
        if klen < self.page_size or klen % self.page_size:
            raise ValueError(
                f"add_host_only_leaf: {len(toks)} tokens; give whole pages of {self.page_size} (+{self._ex})"
            )
        if parent is not self.root and extra_key != parent.extra_key:
            raise ValueError(f"add_host_only_leaf: extra_key {extra_key!r} differs from the parent's")
        if self._find_child(parent, toks, False, 0, extra_key) is not None:
            raise ValueError(f"add_host_only_leaf: node {parent.id} already has a child with this first page")
        ck: Any = toks[0] if self._simple_ck else tuple(toks[: self._ck_len])
        if parent is self.root and extra_key is not None:
            ck = (extra_key, ck)
        self._clock += 1
        leaf = TreeNode(self._owner, self._clock)
        leaf.parent = parent
        leaf.klist = toks
        leaf.klen = klen
        leaf.depth = parent.depth + klen
        leaf.value = None
        leaf.residency = HOST_ONLY
        leaf.extra_key = extra_key
        leaf.ckey = ck
        leaf.last_access = self._tick()
        parent.children[ck] = leaf
        if self._by_first and (parent is not self.root or extra_key is None):
            idx = parent.first
            if idx is None:
                parent.first = {ck[0]: leaf}
            else:
                idx[ck[0]] = leaf if idx.get(ck[0]) is None else _SHARED_FIRST
        self._host_only += 1
        return leaf

    def split_node(self, node: TreeNode, k: int) -> TreeNode:
        """Cut ``node`` after ``k`` key elements (``0 < k < node.klen``, a page multiple); returns
        the new parent. For components that need a node boundary (an SWA window edge)."""
        if node is self.root or node.residency == DELETED or node.owner is not self._owner:
            raise ValueError(f"split_node: {node!r} is not a splittable node of this tree")
        if not 0 < k < node.klen or k % self.page_size:
            raise ValueError(f"split_node: k={k} must be a page multiple strictly inside the node's {node.klen}")
        return self._split(node, k)

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

    # ------------------------------------------------------------------ whole-tree

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

    def eviction_candidates(self) -> list[TreeNode]:
        """FULL's current eviction candidates: unlocked device leaves (no device child)."""
        return list(self._leaves)

    def eviction_queue_size(self) -> int:
        """Entries in FULL's lazy eviction heap plus queued pushes (bounded by a constant times
        the candidates; see ``eviction.py``)."""
        return len(self._heap) + len(self._pending)

    def all_values_flatten(self) -> np.ndarray:
        """Every cached device slot id (int32), in DFS order."""
        vals = [n.value for n in self._nodes() if n.value is not None]
        return np.concatenate(vals) if vals else np.empty(0, dtype=INT32)

    def reset(self) -> None:
        """Drop every cached prefix, free its slots into the allocator (and every component's
        data into its own), emit AllBlocksCleared.

        Nodes and receipts from before the reset are rejected afterwards. Raises
        :class:`LockError` (tree unchanged) while any prefix is locked: requests still use
        those slots; finish or release them first (SGLang flushes only when idle).
        """
        locked = {c.name: c.sizes().protected for c in self.components}
        if any(locked.values()):
            held = ", ".join(f"{name}: {n}" for name, n in locked.items() if n)
            raise LockError(f"reset: locked by running requests or receipts ({held}); release them first")
        vals = [n.value for n in self._nodes() if n.value is not None]
        self._full.free_all(vals)
        for c in self._extra:
            c.on_reset()
        self._clear()
        if self._events is not None:
            self._events.emit(AllBlocksCleared())

    def pretty_print(self) -> str:
        """The tree as indented text: per node its length, first tokens, lock count, residency."""
        lines = []
        stack = [(c, 1) for c in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            toks = node.klist[:10] if node.klist is not None else decode_tokens((node.key or b"")[: 10 * 4])
            more = "..." if node.klen + self._ex > 10 else ""
            ek = "" if node.extra_key is None or node.parent is not self.root else f" extra_key={node.extra_key!r}"
            res = "" if node.residency == DEVICE else f" {RESIDENCY_NAMES[node.residency]}"
            comp = "" if not node.comp else f" comp={sorted(node.comp)}"
            lines.append(f"{'  ' * depth}[{node.klen}] {toks}{more} lock_ref={node.lock_ref}{ek}{res}{comp}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        lines.append(f"#tokens: {self.total_size()} (evictable {self._evictable}, protected {self._protected})")
        return "\n".join(lines)

    def check_invariants(self) -> None:
        """Every invariant of the core and of every component (O(tree)); raises
        :class:`TreeInvariantError`."""
        for c in self.components:
            c.check_invariants()

    def sanity_check(self) -> None:
        """SGLang's name for :meth:`check_invariants`."""
        self.check_invariants()

    def check_full_invariants(self) -> None:
        """Walk the whole tree and check the core's and FULL's invariants (O(tree)).

        Checks: parent/child links and child keys, page-aligned edges with one slot per key
        element on device nodes, depths, residency (device nodes root-closed; host-only nodes
        unlocked, slot-less, and childless only while a component keeps them), lock counts
        (never negative; a parent holds at least its children's), the evictable-leaf set, both
        size counters, the host-only count, and that no slot id is cached twice.
        """
        ps, ex = self.page_size, self._ex

        def fail(msg: str) -> None:
            raise TreeInvariantError(f"check_invariants: {msg}\n{self.pretty_print()}")

        evictable = protected = host_only = 0
        leaves = set()
        vals: list[np.ndarray] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            child_locks = 0
            device_children = 0
            for ck, child in node.children.items():
                if child.parent is not node:
                    fail(f"node {child.id} has a wrong parent")
                if child.owner is not self._owner or child.residency == DELETED:
                    fail(f"node {child.id} is deleted or stale but still linked")
                if child.key is None and child.klist is None:
                    fail(f"node {child.id} has no key")
                if child.key is not None and child.klist is not None and decode_tokens(child.key) != list(child.klist):
                    fail(f"node {child.id}: its two key forms differ")
                expect = self._node_child_key(child)
                if node is self.root and child.extra_key is not None:
                    expect = (child.extra_key, expect)
                if ck != expect or child.ckey != ck:
                    fail(f"node {child.id} is filed under a wrong child key")
                if child.klen <= 0 or child.klen % ps:
                    fail(f"node {child.id}: klen {child.klen}, page {ps}")
                if child.residency == DEVICE:
                    if child.value is None or len(child.value) != child.klen:
                        fail(f"node {child.id}: device node with {child.value!r} slots for klen {child.klen}")
                    if node is not self.root and node.residency != DEVICE:
                        fail(f"node {child.id}: device node under host-only node {node.id}")
                    device_children += 1
                else:
                    host_only += 1
                    if child.value is not None or child.lock_ref:
                        fail(f"node {child.id}: host-only node with slots or locks")
                    if not child.children and not any(c.keeps_node(child) for c in self._extra):
                        fail(f"node {child.id}: childless host-only node that no component keeps")
                if len(child.token_ids()) != child.klen + ex:
                    fail(f"node {child.id}: {len(child.token_ids())} key tokens for klen {child.klen}")
                if child.depth != node.depth + child.klen:
                    fail(f"node {child.id}: depth {child.depth} != {node.depth} + {child.klen}")
                if node is not self.root and child.extra_key != node.extra_key:
                    fail(f"node {child.id}: namespace differs from its parent's")
                if ex and node is not self.root and node.token_ids()[-1] != child.token_ids()[0]:
                    fail(f"node {child.id}: bigram edge does not overlap its parent's last token")
                if child.lock_ref < 0:
                    fail(f"node {child.id}: lock_ref {child.lock_ref} < 0")
                if self._events is not None and (child.hashes is None or len(child.hashes) != child.klen // ps):
                    got = None if child.hashes is None else len(child.hashes)
                    fail(f"node {child.id}: {got} page hashes for {child.klen // ps} pages")
                child_locks += child.lock_ref
                if child.residency == DEVICE:
                    if child.lock_ref:
                        protected += child.klen
                    else:
                        evictable += child.klen
                    if child.value is not None:
                        vals.append(child.value)
                stack.append(child)
            if node is not self.root and node.residency == DEVICE and not node.lock_ref and not device_children:
                leaves.add(node)
            if self._by_first and (node.children or node.first):
                idx = node.first or {}
                # Root children of a namespace (``(extra_key, page)`` keys) are not indexed.
                indexed = [ck for ck, c in node.children.items() if node is not self.root or c.extra_key is None]
                for ck in indexed:
                    child = node.children[ck]
                    entry = idx.get(ck[0])
                    if entry is not child and entry is not _SHARED_FIRST:
                        fail(f"node {node.id}: child {child.id} is missing from the first-token index")
                for tok, entry in idx.items():
                    if entry is _SHARED_FIRST:
                        continue
                    if entry.parent is not node or node.children.get(entry.ckey) is not entry or entry.ckey[0] != tok:
                        fail(f"node {node.id}: first-token index entry {tok} is not a child starting with it")
                    if sum(1 for ck in indexed if ck[0] == tok) > 1:
                        fail(f"node {node.id}: first token {tok} is shared but indexed as one child")
            if node is not self.root and node.lock_ref < child_locks:
                fail(f"node {node.id}: lock_ref {node.lock_ref} < its children's {child_locks}")
        if evictable != self._evictable or protected != self._protected:
            fail(
                f"counters evictable={self._evictable} protected={self._protected}, "
                f"tree has evictable={evictable} protected={protected}"
            )
        if host_only != self._host_only:
            fail(f"host-only count {self._host_only}, tree has {host_only}")
        if leaves != self._leaves:
            fail(f"evictable-leaf set differs: {len(self._leaves)} tracked, {len(leaves)} in the tree")
        live = {id(n) for _, s, n in self._heap if n.heap_seq == s}
        live.update(id(n) for n in self._pending if n.heap_seq == _PENDING)
        if any(id(n) not in live for n in leaves):
            fail("an evictable leaf has no live heap entry and is not queued for one")
        if vals:
            allv = np.concatenate(vals)
            if self.trash_in_values:
                allv = allv[allv != 0]  # tombstones of a pure-SWA tree hold the trash slot
            if np.unique(allv).size != allv.size:
                fail("a slot id is cached in two places")
