"""The walk: one loop that follows a key down the tree, for match and for insert alike.

A walk starts at a node (the root, or a request's locked node for a resumed insert) and, per
node on the path, looks the next child up (the only child lookup of the tree: by the page's
first token, by its page key where first tokens clash or in a namespace at the root), compares
the child's edge with the request's window in one C-level compare, and on a partial match finds
the page-aligned shared length (``_common``) and splits the child there (``_split``). What it
does per node differs by purpose:

* match: collects the nodes' slot arrays and stops after a split (the match ends inside);
  without components it also stamps access times (with components the caller stamps from where
  the match finally ends, ``touch_to_root``);
* insert: stamps access times, raises priorities, counts hits, lets host-only nodes and
  components see the overlap (``_overlap``), then adds the unmatched remainder as one new leaf.

Invariants kept: edges are whole pages; a node's ``children`` maps each child's child key to it
(``TreeNode``: its first token, its page key for tokens in ``clash``, namespaced at the root).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from kvjax.radix.eviction_heap import PENDING
from kvjax.radix.host_residency import HostResidency
from kvjax.radix.keys import INT32, NO_COPY_COMPARE_MIN, list_starts_with
from kvjax.radix.node import DELETED, HOST_ONLY, TreeNode
from kvjax.radix.retention import merge_retention

# A donated key whose head is cached is kept whole by the new leaf (``TreeNode.kshare``) while
# that head is at most this many times the leaf's own edge.
SHARE_MAX_HEAD = 8
# SGLang clamps the prompt re-insert's ``priority + 1`` to int64.
_PRIORITY_MAX = 2**63 - 1


class TreeWalk(HostResidency):
    """The tree layer that walks keys, splits edges and adds nodes (module docstring)."""

    __slots__ = ()

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
                    if (
                        list_starts_with(src, kl)
                        if not off and nt == len(kl) and nt >= NO_COPY_COMPARE_MIN
                        else src[off : off + nt] == (kl if nt == len(kl) else kl[:nt])
                    ):
                        return lim
                elif self._cut_confirms(node, kl, src, off, nt):
                    return lim
            else:
                # A difference at the end: guess where the shared part ends by bisecting
                # pages on their last token (single elements with bigram keys), as tokens past a
                # shared prefix rarely agree, then confirm the guess with one compare. Each
                # slice costs ~2 ns per element (references are taken and dropped), a probe
                # ~40 ns plus a cache miss or two on a cold request, so this reads ~first
                # elements where the plain bisect reads ~4 * nt; probing pages, not elements,
                # saves four probes on a 16-token page. A wrong guess only narrows the bisect
                # below.
                step = 1 if ex else self.page_size
                a, b = 0, last // step  # unit b's last element differs
                while a < b:
                    mid = (a + b) >> 1
                    i = mid * step + step - 1
                    x = src[off + i]
                    y = kl[i]
                    if x is y or x == y:  # shared token objects: no read of the int itself
                        a = mid + 1
                    else:
                        b = mid
                a *= step  # the guess: elements [0, a) agree, the unit from a does not
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
        if list_starts_with(src, kl) if not off and k >= NO_COPY_COMPARE_MIN else src[off : off + k] == kl:
            self._cut_node = node
            self._cut_tail = tail
            return True
        kl += tail
        return False

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child`` after ``k`` key elements; returns the new parent holding them.

        Sizes do not change (tokens move between two nodes with the same lock count), the
        new parent inherits lock_ref, priority, retention, hit_count and residency, and page hashes are cut
        at the page boundary so they stay what they were. Components redistribute their data
        in ``on_split``.
        """
        ex = self._ex
        self._clock += 1
        parent = child.parent
        if child.kshare is not None:
            self._klist(child)  # the edge of a shared list becomes the node's own first
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
        new.retain_priority = child.retain_priority  # both halves were inserted through
        new.retain_until = child.retain_until
        new.ckey = child.ckey  # the same first page: the same key
        parent.children[child.ckey] = new
        child.klen -= k
        # The lower part is its new parent's only child: filed by its first token.
        lower = child.klist
        ck = lower[0] if lower is not None else self._first_struct.unpack_from(self._kbytes(child), 0)[0]
        child.ckey = ck
        child.parent = new
        new.children = {ck: child}
        if child.hashes is not None:
            p = k // self.page_size
            new.hashes = child.hashes[:p]
            child.hashes = child.hashes[p:]
        if self._eager and child in self._leaves:
            self._evq.defer_push(child)  # it was just touched: a non-monotone priority moved
        for c in self._extra:
            c.on_split(new, child, k)
        return new

    def _walk(
        self,
        start: TreeNode,
        src: Any,
        is_bytes: bool,
        n: int,
        extra_key: Hashable,
        t: int,
        inserting: bool,
        values: np.ndarray | None = None,
        priority: int = 0,
        hit_from: int = 0,
        collect: bool = True,
        payloads: Mapping[str, Any] | None = None,
        donated: bool = False,
    ) -> tuple[TreeNode, int, list]:
        """Follow key elements ``[0, n)`` of ``src`` (n page-aligned) down from ``start``, whose
        path must be the prefix of the key that precedes ``src``. Returns ``(last node, elements
        matched, value arrays of the matched nodes)`` (the list is empty for an insert without
        ``collect``); for an insert the last node is the one covering element ``n - 1`` (a new
        leaf for the unmatched remainder) and the elements matched are those
        already cached.

        Both purposes split the node where the shared part ends inside it (the part below the cut
        keeps the touch ``t``, as SGLang's split stamps it). A match (``inserting`` False) stops
        there; without components it stamps the nodes on the path with time ``t``. An insert
        stamps every node on the path, raises its priority to ``priority``, counts one hit on a
        node whose end depth exceeds ``hit_from`` (SGLang 0.5.23's ``inserted_len``: a request
        counts each node once), and, while components listen or host-only nodes exist, revives a
        host-only node from ``values[off:off + k]`` and calls the components'
        ``on_insert_overlap`` with their ``payloads`` (by name). ``values[i]`` is the slot of
        element ``i`` (None: synthesize ids, simulation only); a host-only node on the path
        becomes device-resident from the incoming slots and counts as already cached.
        ``donated``: a list ``src`` is the caller's to give away; the new leaf keeps ``src``
        itself, its tail past ``n`` cut off, not a copy: as its edge when nothing matched,
        else as ``kshare`` (the edge is its tail; see ``SHARE_MAX_HEAD``).
        """
        node = start
        root = self.root
        off = 0
        vals: list = []
        ex = self._ex
        first = self._first_struct  # (a bound ``unpack_from`` here would be allocated per walk)
        touch = inserting or not self._extra
        slow = inserting and (bool(self._extra) or self._host_only > 0)
        keep = collect or not inserting
        while True:
            # The child lookup (``TreeNode``'s child keys). A call per node costs ~80 ns, so it
            # is written out here once. A child found by its first token may still differ later
            # in its first page, which the compare below finds.
            if extra_key is not None and node is root:
                child = node.children.get((extra_key, self._page_key(src, is_bytes, off)))
            else:
                tok = first.unpack_from(src, off * 4)[0] if is_bytes else src[off]
                child = node.children.get(tok)
                if child is None and node.clash is not None and tok in node.clash:
                    child = node.children.get(self._page_key(src, is_bytes, off))
            if child is None:
                break
            m = child.klen
            rem = n - off
            if m <= rem and (
                src[off * 4 : (off + m + ex) * 4] == (child.key if child.key is not None else self._kbytes(child))
                if is_bytes
                else (
                    src[off : off + m + ex] == (child.klist if child.klist is not None else self._klist(child))
                    if off or m < NO_COPY_COMPARE_MIN
                    # A child of the root (a long shared prompt): no window copy of the request.
                    else list_starts_with(src, child.klist if child.klist is not None else self._klist(child))
                )
            ):
                if touch:
                    child.last_access = t
                k = m
            else:
                k = self._common(child, src, is_bytes, off, m if m < rem else rem)
                if not k:
                    break  # a first-token candidate whose first page differs
                child.last_access = t  # the part below the cut keeps the touch
                child = self._split(child, k)
                if not inserting:
                    vals.append(child.value)
                    off += k
                    node = child
                    break  # the match ends inside the split node
            if inserting:
                if priority > child.priority:
                    child.priority = priority
                if child.depth > hit_from:
                    child.hit_count += 1
                if slow:  # host-only nodes exist or components listen: off the full-KV-only path
                    self._overlap(node, child, values, off, k, payloads)
                    if collect and child.parent is not node:
                        # A component split the node (an SWA window edge): the upper parts first.
                        upper = []
                        u = child.parent
                        while u is not node:
                            upper.append(u.value)
                            u = u.parent
                        vals.extend(reversed(upper))
            if keep:
                vals.append(child.value)
            off += k
            node = child
            if off >= n:
                break
        if not inserting:
            return node, off, vals
        if off >= n:
            if self._eager and node in self._leaves:
                self._evq.defer_push(node)
            return node, off, vals
        # The unmatched remainder: one new device leaf (slots copied: callers reuse their rows; or
        # synthesized without ``values``). It becomes an eviction candidate and ``node`` stops
        # being one; the components' ``on_new_node`` see it.
        klen = n - off
        if values is None:
            v = np.arange(self._sim_next, self._sim_next + klen, dtype=INT32)
            self._sim_next += klen
        else:
            v = values[off:n].copy()
            if self._full.tracks:  # an allocator that refuses others' frees of the tree's slots
                self._full.hold(v)
        self._clock += 1
        depth = node.depth + klen
        hits = 1 if depth > hit_from else 0
        if is_bytes:
            kb = src[off * 4 : (n + ex) * 4]
            leaf = TreeNode(self._owner, self._clock, node, None, kb, klen, depth, v, priority, hits, extra_key)
            tok = first.unpack_from(kb, 0)[0]
        else:
            if donated and off <= SHARE_MAX_HEAD * klen:
                # The caller's list, given away: no copy (an insert's costliest step). Its part
                # past the key is cut off; a cached head stays, and the leaf holds the list as
                # ``kshare`` until its own list is first needed (bounded: the head is at most
                # SHARE_MAX_HEAD times the edge, so held keys stay O(cached tokens)).
                if len(src) > n + ex:
                    del src[n + ex :]
                kl = None if off else src
            else:
                kl = src[off : n + ex]
            leaf = TreeNode(self._owner, self._clock, node, kl, None, klen, depth, v, priority, hits, extra_key)
            if kl is None:
                leaf.kshare = src
                leaf.kshare_from = off
            tok = src[off]
        self._link_child(node, leaf, tok, extra_key)
        self._evictable += klen
        leaves = self._leaves
        leaves.discard(node)  # it has a child now
        leaves.add(leaf)
        evq = self._evq  # EvictionHeap.defer_push, inlined: once per insert
        leaf.heap_seq = PENDING
        pending = evq.pending
        pending.append(leaf)
        if len(pending) > 2 * len(leaves) + 1024:
            evq.flush()
        self.stats.inserted_tokens += klen
        if self._events is not None:
            self._emit_stored(leaf)
        if self._extra:
            for c in self._extra:
                c.on_new_node(leaf, payloads.get(c.name) if payloads else None)
        return leaf, off, vals

    def _link_child(self, parent: TreeNode, child: TreeNode, tok: int, extra_key: Hashable) -> None:
        """File the new ``child``, whose edge begins with token ``tok``, in ``parent.children``
        (``TreeNode``'s child keys). A second child beginning with ``tok`` puts it in
        ``parent.clash``: both are keyed by their first page from then on."""
        children = parent.children
        if parent is self.root and extra_key is not None:
            ck: Any = (extra_key, self._node_page_key(child))
        else:
            clash = parent.clash
            if clash is not None and tok in clash:
                ck = self._node_page_key(child)
            else:
                other = children.get(tok)
                if other is None:
                    ck = tok
                else:
                    del children[tok]
                    ok = other.ckey = self._node_page_key(other)
                    children[ok] = other
                    if clash is None:
                        parent.clash = {tok}
                    else:
                        clash.add(tok)
                    ck = self._node_page_key(child)
        child.ckey = ck
        children[ck] = child

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

    def touch_to_root(self, node: TreeNode, t: int) -> None:
        """Access time ``t`` for ``node`` and its ancestors: a match's recency refresh, from the
        node where it finally ends (SGLang 0.5.23's ``_match_post_processor``), never for deeper
        nodes its walk passed. O(depth)."""
        root = self.root
        while node is not root:
            node.last_access = t
            node = node.parent

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
            self._evq.defer_push(node)
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

    def retain_path(self, node: TreeNode, priority: int, seconds: float | None) -> None:
        """Retain ``node`` and its ancestors for ``seconds`` from the retention clock's reading at
        ``priority`` (``retention.py``: max priority, latest expiry). None or 0 seconds retain
        nothing. A candidate whose retention priority went down (a lapsed one renewed lower) is
        re-queued in the eviction heap. O(depth)."""
        if not seconds:
            return
        evq = self._evq
        now = evq.now
        until = now + seconds
        if until <= now:
            return
        root = self.root
        leaves = self._leaves
        while node is not root and node.residency != DELETED:
            if merge_retention(node, priority, until, now) and node in leaves:
                evq.defer_push(node)
            node = node.parent

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
        other = self.find_child(parent, toks, 0, extra_key)
        if other is not None and self._node_page_key(other) == self._page_key(toks, False, 0):
            raise ValueError(f"add_host_only_leaf: node {parent.id} already has a child with this first page")
        self._clock += 1
        leaf = TreeNode(self._owner, self._clock)
        leaf.parent = parent
        leaf.klist = toks
        leaf.klen = klen
        leaf.depth = parent.depth + klen
        leaf.value = None
        leaf.residency = HOST_ONLY
        leaf.extra_key = extra_key
        leaf.last_access = self._tick()
        self._link_child(parent, leaf, toks[0], extra_key)
        self._host_only += 1
        return leaf

    def find_child(
        self, node: TreeNode, tokens: list[int], off: int = 0, extra_key: Hashable = None
    ) -> TreeNode | None:
        """The child of ``node`` that the page at ``tokens[off:]`` (key elements) would continue
        into, or None. It begins with the page's first token; the rest of its first page may
        differ (compare its edge to know). Changes nothing."""
        if node is self.root and extra_key is not None:
            return node.children.get((extra_key, self._page_key(tokens, False, off)))
        tok = tokens[off]
        child = node.children.get(tok)
        if child is None and node.clash is not None and tok in node.clash:
            child = node.children.get(self._page_key(tokens, False, off))
        return child

    def split_node(self, node: TreeNode, k: int) -> TreeNode:
        """Cut ``node`` after ``k`` key elements (``0 < k < node.klen``, a page multiple); returns
        the new parent. For components that need a node boundary (an SWA window edge)."""
        if node is self.root or node.residency == DELETED or node.owner is not self._owner:
            raise ValueError(f"split_node: {node!r} is not a splittable node of this tree")
        if not 0 < k < node.klen or k % self.page_size:
            raise ValueError(f"split_node: k={k} must be a page multiple strictly inside the node's {node.klen}")
        return self._split(node, k)
