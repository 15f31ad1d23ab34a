"""A Hypothesis state machine over HiSWARadixCache (FULL + SWA + host) with a real
SWATokenToKVPoolAllocator and the simulated copy engine.

The rules of ``test_swa_machine.py`` (inserts with SWA-evicted prefixes, matches against the naive
rule, locks, early SWA releases, evictions of both pools) plus the host tier's: polling the
transfers, host eviction, and load-backs of host hits. After every step: every component's
invariants, the allocator's, and ``available + evictable + protected == capacity`` for the full
pool, the SWA pool and the host pool. A load-back's match ends where the naive SWA rule says.
Every host eviction (write_back's reclaim of host copies of device nodes included) is checked by
``host_eviction_check.py``.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.radix import HiSWARadixCache
from tests.radix.host_eviction_check import check_host_evictions
from tests.radix.test_swa_machine import SWATreeMachine


class HiSWATreeMachine(SWATreeMachine):
    @initialize(
        ps=st.sampled_from([1, 2]),
        window=st.integers(1, 5),
        eagle=st.booleans(),
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    )
    def setup(self, ps: int, window: int, eagle: bool, policy: str = "write_through") -> None:  # type: ignore[override]
        alloc = SWATokenToKVPoolAllocator(24 * ps, 12 * ps, ps)
        tree = HiSWARadixCache(
            page_size=ps,
            sliding_window_size=window,
            allocator=alloc,
            is_eagle=eagle,
            host_pool_tokens=32 * ps,
            write_policy=policy,
            load_back_threshold=1,
        )
        check_host_evictions(tree)
        self._start(ps, alloc, tree, eagle)

    @rule(wait=st.booleans())
    def transfers(self, wait: bool) -> None:
        self.tree.check_transfers(wait)

    @rule(amount=st.integers(0, 12))
    def evict_host(self, amount: int) -> None:
        self.tree.evict_host(amount)

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        key = self.key(data)
        m = self.tree.match_prefix(key)
        # SWA may shorten the device match; FULL KV on device or host covers both hits.
        assert m.device_kv_hit_length >= m.prefix_len
        assert m.full_kv_hit_length >= max(m.device_kv_hit_length, m.prefix_len + m.host_hit_length)
        if not m.host_hit_length:
            return
        loaded = self.tree.init_load_back(m)
        if loaded is m:
            return  # no room on the device: nothing changed
        assert loaded.prefix_len == m.prefix_len + m.host_hit_length
        again = self.tree.match_prefix(key)
        assert again.prefix_len >= loaded.prefix_len  # the loaded window is live SWA
        expect, _ = self.naive_match(key)
        assert again.prefix_len == expect

    @rule(data=st.data())
    def demote_all_then_reuse(self, data: st.DataObject) -> None:
        """Demote what FULL can evict (write_back backs it up now), bring a key back (a load-back,
        or an insert over host-only nodes), poll, and evict host copies: under write_back the
        nodes brought back hold device and host copies, which host eviction reclaims first."""
        self.tree.check_transfers(wait=True)
        self.tree.evict(self.tree.evictable_size(), 0)
        if data.draw(st.booleans()):
            self.load_back(data)
        else:
            self.insert(data)
        self.tree.check_transfers(wait=data.draw(st.booleans()))
        self.tree.evict_host(data.draw(st.integers(1, 12)))

    @invariant()
    def host_balanced(self) -> None:
        if not hasattr(self, "tree"):
            return
        host = self.tree.host_allocator
        s = self.tree.sizes()["host"]
        assert host.available_size() + s.evictable + s.protected == host.size


HiSWATreeMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHiSWATreeMachine = HiSWATreeMachine.TestCase
