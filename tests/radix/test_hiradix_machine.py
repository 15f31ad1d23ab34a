"""A Hypothesis state machine over a HiRadixCache with a device allocator and a host pool.

The simulated copy engine carries a label per slot (the token written there), so after every
step the machine checks that each device node's slots and each landed host copy hold exactly the
node's tokens: nothing is lost or mixed up by demotion, load-back, host eviction, failed backups
or failed loads. After every step: the tree's and every component's invariants, and
``available + cached (+ held by locks) == capacity`` for the device allocator and the host pool.
A naive model (the set of inserted keys) checks that every device match plus host hit is a
prefix of an inserted key, and so is ``full_kv_hit_length`` (FULL KV on device or host). Every
host eviction, write_back's reclaim of host copies of device nodes included, is checked by
``host_eviction_check.py``; the write_back rules below make such copies (load-backs, inserts
over host-only nodes) and fill the host pool so that backups must reclaim room.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvjax.alloc import make_allocator
from kvjax.radix import HiRadixCache
from kvjax.tiers import SimulatedCopyEngine
from tests.radix.host_eviction_check import check_host_evictions

PAGE = 2
keys = st.lists(st.integers(1, 3), min_size=PAGE, max_size=10).map(lambda k: k[: len(k) - len(k) % PAGE])


class HostTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = SimulatedCopyEngine()
        self.alloc = make_allocator(16, PAGE)
        self.tree = HiRadixCache(
            page_size=PAGE,
            token_to_kv_pool_allocator=self.alloc,
            host_pool_tokens=24,
            copy_engine=self.engine,
            load_back_threshold=4,
        )
        self.inserted: list[tuple[int, ...]] = []
        self.locks: list = []

    @initialize(policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]))
    def choose_policy(self, policy):
        self._build(policy, 24)

    def _build(self, policy, host_tokens):
        self.tree = HiRadixCache(
            page_size=PAGE,
            token_to_kv_pool_allocator=self.alloc,
            host_pool_tokens=host_tokens,
            copy_engine=self.engine,
            write_policy=policy,
            load_back_threshold=4,
        )
        check_host_evictions(self.tree)

    @rule(key=keys, poll_first=st.booleans())
    def insert(self, key, poll_first):
        self._insert(key, poll_first)

    def _insert(self, key, poll_first):
        tree, alloc = self.tree, self.alloc
        if poll_first:  # the scheduler's polling step before the next batch
            tree.check_transfers()
        if alloc.available_size() < len(key):
            tree.evict(len(key) - alloc.available_size())
        slots = alloc.alloc(len(key))
        if slots is None:
            return
        for s, t in zip(slots, key, strict=True):
            self.engine.device[int(s)] = t
        prefix = tree.insert(list(key), slots)
        # duplicates are the slots the tree did not take (a revived host-only node takes them)
        held = tree.match_prefix(list(key)).indices[:prefix]
        alloc.free(slots[:prefix][slots[:prefix] != held])
        self.inserted.append(tuple(key))

    @precondition(lambda self: self.inserted)
    @rule(which=st.integers(0, 50), lock=st.booleans())
    def match_seen(self, which, lock):
        self._match(list(self.inserted[which % len(self.inserted)]), lock)

    @precondition(lambda self: self.inserted)
    @rule(which=st.integers(0, 50))
    def demote_all_then_match_seen(self, which):
        self.tree.check_transfers()
        self.tree.evict(self.alloc.size)
        self._match(list(self.inserted[which % len(self.inserted)]), False)

    @precondition(lambda self: self.inserted)
    @rule(which=st.integers(0, 50))
    def insert_seen(self, which):
        self._insert(list(self.inserted[which % len(self.inserted)]), True)

    @rule(key=keys, lock=st.booleans())
    def match_and_load(self, key, lock):
        self._match(key, lock)

    def _match(self, key, lock):
        tree = self.tree
        m = tree.match_prefix(list(key))
        reach = m.prefix_len + m.host_hit_length
        assert any(k[:reach] == tuple(key[:reach]) for k in self.inserted) or reach == 0
        # No component shortens this tree's match: the hit on device or host is the device match
        # plus the host hit.
        assert (m.device_kv_hit_length, m.full_kv_hit_length) == (m.prefix_len, reach)
        before = m.prefix_len
        m = tree.init_load_back(m)
        if m.prefix_len > before:
            event("loaded back")
        assert [self.engine.device[int(s)] for s in m.indices] == list(key[: m.prefix_len])
        if lock and m.prefix_len:
            self.locks.append(tree.inc_lock_ref(m.last_node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 7))
    def unlock(self, i):
        self.tree.dec_lock_ref(self.locks.pop(i % len(self.locks)))

    @rule(n=st.integers(1, 20))
    def evict_device(self, n):
        self.tree.evict(n)

    @rule(n=st.integers(1, 20))
    def evict_host(self, n):
        self.tree.evict_host(n)

    @precondition(lambda self: self.inserted)
    @rule(which=st.integers(0, 50), fresh=keys, n=st.integers(1, 20), host_first=st.booleans())
    def demote_revive_then_evict(self, which, fresh, n, host_first):
        """Demote everything, insert a seen key over its host-only nodes (under write_back they
        now hold device and host copies) and a fresh one, then evict host copies, or device
        leaves (write_back backs them up into a fuller host pool, reclaiming room)."""
        self.tree.check_transfers()
        self.tree.evict(self.alloc.size)
        self._insert(list(self.inserted[which % len(self.inserted)]), False)
        self._insert(fresh, False)
        if host_first:
            self.tree.evict_host(n)
        else:
            self.tree.evict(n)

    @rule(wait=st.booleans())
    def poll(self, wait):
        self.tree.check_transfers(wait)

    @rule()
    def fail_next_backup(self):
        self.engine.fail_backups += 1

    @rule()
    def fail_next_load(self):
        self.engine.fail_loads += 1

    @invariant()
    def consistent(self):
        tree = self.tree
        tree.check_invariants()
        assert self.alloc.available_size() + tree.total_size() == self.alloc.size
        host = tree.host_allocator
        s = tree.sizes()["host"]
        assert host.available_size() + s.evictable + s.protected == host.size
        for node in tree.nodes():
            tokens = node.token_ids()
            if node.value is not None:
                assert [self.engine.device[int(x)] for x in node.value] == tokens
            data = tree.host.data(node)
            if data is not None and data.transfer is None:
                assert [self.engine.host[int(x)] for x in data.slots] == tokens

    def teardown(self):
        for r in self.locks:
            self.tree.dec_lock_ref(r)
        self.tree.reset()
        assert self.alloc.available_size() == self.alloc.size
        assert self.tree.host_allocator.available_size() == self.tree.host_allocator.size


HostTierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestHostTierMachine = HostTierMachine.TestCase


class WriteBackMachine(HostTierMachine):
    """The same rules under write_back only, with host pools from smaller than the device pool
    to larger, so that host eviction and backups must reclaim host copies of device nodes."""

    @initialize(host_tokens=st.sampled_from([8, 16, 24]))
    def choose_policy(self, host_tokens):
        self._build("write_back", host_tokens)


WriteBackMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestWriteBackMachine = WriteBackMachine.TestCase
