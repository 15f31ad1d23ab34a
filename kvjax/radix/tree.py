"""The radix tree core: one pure-Python tree of page-granular edges (see keys.py for how keys
are represented and why), and its eviction.

``RadixTree`` is the class to use; it is built in layers, one concept per module (the table is
in ``tree_state.py``): state and sizes, host residency, the walk, path locks, and here eviction,
reset and the invariant check. Presets (``RadixCache``) add the public contract, input checks and
the request lifecycle. Components (``component.py``) attach further state.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import overload

import numpy as np

from kvjax.radix.events import AllBlocksCleared, BlockRemoved
from kvjax.radix.invariants import TreeInvariantError, check_core_invariants
from kvjax.radix.lock import LockError
from kvjax.radix.node import DELETED
from kvjax.radix.path_locks import PathLocks

__all__ = ["RadixTree", "TreeInvariantError"]


class RadixTree(PathLocks):
    """The tree core. See ``RadixCache`` for the public, checked API, and :class:`TreeState`
    (``tree_state.py``) for the constructor's arguments."""

    __slots__ = ()

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
        least ``num_tokens`` tokens are freed or none is left. Leaves retained at the retention
        clock (``retention.py``) go only once no unretained leaf is left, the lowest retention
        priority first, then by the policy.

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
        evq = self._evq
        if evq.pending:
            evq.flush()
        # Host-only nodes need a component that keeps them: without components, none appear.
        if self._extra or self._host_only > 0:
            return self._evict_generic(num_tokens)
        expiries = evq.expiries
        now = evq.now
        if expiries and expiries[0][0] <= now:
            evq.expire()
        heap = evq.heap
        retained = evq.retained
        prio = self._prio
        heappop = heapq.heappop
        heappush = heapq.heappush
        root = self.root
        free = self._full.free if self._full.allocator is not None else None
        emit = self._events.emit if self._events is not None else None
        evicted = 0
        num_nodes = 0
        while evicted < num_tokens:
            if heap:
                p, seq, node = heappop(heap)
                if node.heap_seq != seq or node not in leaves:
                    continue  # dead entry: node changed state or was re-pushed since
                if node.retain_until > now:  # retained since its push: to the retained tier
                    evq.push(node)
                    continue
                cur = prio(node)
                if cur != p:  # stale (monotone policies only grow): requeue at its true place
                    evq.seq = seq = evq.seq + 1
                    node.heap_seq = seq
                    heappush(heap, (cur, seq, node))
                    continue
                tier = heap
            elif retained:
                # Nothing unretained is left: the retained tier (module docstring of eviction_heap).
                p, seq, node = heappop(retained)
                if node.heap_seq != seq or node not in leaves:
                    continue
                if node.retain_until <= now or p != (node.retain_priority, prio(node)):
                    evq.push(node)  # lapsed, or its retention or priority grew: its true place
                    continue
                tier = retained
            else:
                break
            if free is not None:
                try:
                    free(node.value)  # first: a refused free leaves this node and the counters consistent
                except BaseException:
                    heappush(tier, (p, seq, node))  # still a candidate
                    self._evictable -= evicted
                    raise
            evicted += node.klen
            num_nodes += 1
            parent = node.parent
            del parent.children[node.ckey]
            leaves.discard(node)
            node.value = None
            node.residency = DELETED
            node.heap_seq = -1
            if emit is not None:
                emit(BlockRemoved(block_hashes=list(node.hashes or ())))
            if parent is not root and parent.lock_ref == 0 and not parent.children:
                leaves.add(parent)
                if parent.retain_until > now:
                    evq.push(parent)
                else:
                    evq.seq = seq = evq.seq + 1
                    parent.heap_seq = seq
                    heappush(heap, (prio(parent), seq, parent))
        self._evictable -= evicted  # every evicted node was an unlocked (evictable) leaf
        stats = self.stats
        stats.evicted_tokens += evicted
        stats.num_evictions += num_nodes
        return evicted

    def _evict_generic(self, num_tokens: int) -> int:
        """``evict_full`` while components are attached or host-only nodes exist: each
        candidate goes through :meth:`_evict_device_leaf` (demote or delete, cascade)."""
        pop = self._evq.pop_candidate
        evicted = 0
        num_nodes = 0
        while evicted < num_tokens:
            node = pop()
            if node is None:
                break
            try:
                self._evict_device_leaf(node)
            except BaseException:  # a refused free (the node unchanged): it stays a candidate
                self._evq.defer_push(node)
                raise
            evicted += node.klen
            num_nodes += 1
        self.stats.evicted_tokens += evicted
        self.stats.num_evictions += num_nodes
        return evicted

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

    def check_invariants(self) -> None:
        """Every invariant of the core and of every component (O(tree)); raises
        :class:`TreeInvariantError`."""
        for c in self.components:
            c.check_invariants()

    def sanity_check(self) -> None:
        """SGLang's name for :meth:`check_invariants`."""
        self.check_invariants()

    def check_full_invariants(self) -> None:
        """Walk the whole tree and check the core's and FULL's invariants (O(tree); see
        ``invariants.py``); raises :class:`TreeInvariantError`."""
        check_core_invariants(self)
