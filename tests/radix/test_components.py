"""The component interface, rule by rule, on the test state component: per-component evict
amounts and counts, cascades, tombstones, residency, insert payloads, match results, locks."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.radix import ComponentSizes, LockError, RadixCache, TreeComponent
from tests.radix._helpers import RecordingAllocator
from tests.radix.state_component import StatePool, StateSlotComponent


class Tree:
    """A FULL + state tree with a real allocator; ``put`` inserts with fresh slots."""

    def __init__(self, states: int = 4, size: int = 64) -> None:
        self.pool = StatePool(states)
        self.alloc = RecordingAllocator(size, 1)
        self.t = RadixCache(token_to_kv_pool_allocator=self.alloc, components=[StateSlotComponent(self.pool)])

    def put(self, tokens, state=True):
        values = self.last_values = self.alloc.alloc(len(tokens))
        payloads = {"state": self.pool.alloc()} if state else None
        result = self.t.insert_with(tokens, values, payloads=payloads)
        held = set(self.t.all_values_flatten().tolist())  # a revived node took the incoming slots
        dup = np.array([v for v in values[: result.prefix_len].tolist() if v not in held], np.int32)
        if dup.size:
            self.alloc.free(dup)
        self.alloc.take()
        return result

    def sizes(self):
        return {name: (s.evictable, s.protected) for name, s in self.t.sizes().items()}


def test_match_ends_at_the_deepest_state_and_reports_full_length():
    tr = Tree()
    tr.put([1, 2, 3])
    tr.put([1, 2, 3, 4, 5], state=False)
    m = tr.t.match_prefix([1, 2, 3, 4, 5])
    assert (m.prefix_len, m.full_kv_hit_length) == (3, 5)
    assert m.extras["state"] == {"slot": 0, "host_hit_length": 0} and m.indices.tolist() == [1, 2, 3]
    tr.t.check_invariants()


def test_insert_over_an_existing_state_hands_the_donated_slot_back():
    tr = Tree()
    tr.put([1, 2, 3])
    again = tr.put([1, 2, 3])
    assert again.prefix_len == 3 and again.results == {"state": 1}
    assert tr.sizes()["state"] == (1, 0)


def test_state_eviction_tombstones_internal_nodes_and_deletes_leaves():
    tr = Tree()
    tr.put([1, 2])  # internal once [1, 2, 3, 4] hangs below
    tr.put([1, 2, 3, 4])
    counts = tr.t.evict({"state": 1})  # least recent: [1, 2] -> a tombstone
    assert counts == {"full": 0, "state": 1} and tr.pool.take() == [0]
    assert tr.t.match_prefix([1, 2]).prefix_len == 0 and tr.t.total_size() == 4
    counts = tr.t.evict({"state": 1})  # the leaf: deleted with its FULL KV
    assert counts == {"full": 2, "state": 1} and tr.alloc.take() == [5, 6]
    assert tr.t.total_size() == 2 and tr.t.match_prefix([1, 2, 3, 4]).full_kv_hit_length == 2
    tr.t.check_invariants()


def test_a_leaf_whose_full_part_is_locked_becomes_a_tombstone():
    tr = Tree()
    tr.put([1, 2, 3])
    m = tr.t.match_prefix([1, 2, 3])
    receipt = tr.t.inc_lock_ref(m.last_node)
    assert tr.sizes() == {"full": (0, 3), "state": (0, 1)}  # the state lock: the node itself
    assert tr.t.evict({"state": 1}) == {"full": 0, "state": 0}  # locked: nothing to free
    tr.t.dec_lock_ref(receipt)
    tr.put([4, 5], state=False)
    receipt = tr.t.inc_lock_ref(tr.t.root.children[4])
    tr.put([4, 5])  # the FULL-locked leaf gets a state after the lock: not state-locked
    assert tr.sizes()["state"] == (2, 0)
    assert tr.t.evict({"state": 2}) == {"full": 3, "state": 2}  # [1, 2, 3] deleted
    assert tr.t.total_size() == 2  # the FULL-locked leaf [4, 5] kept, now a state tombstone
    assert tr.t.match_prefix([4, 5]).full_kv_hit_length == 2
    tr.t.dec_lock_ref(receipt)
    tr.t.check_invariants()


def test_full_eviction_keeps_a_state_node_host_only_and_an_insert_revives_it():
    tr = Tree()
    tr.put([1, 2])
    tr.put([1, 2, 3, 4])
    assert tr.t.evict({"full": 1}) == {"full": 2, "state": 0}
    assert tr.alloc.take() == [5, 6] and tr.t.host_only_count == 1
    m = tr.t.match_prefix([1, 2, 3, 4])
    assert (m.prefix_len, m.extras["state"]["host_hit_length"]) == (2, 2)
    assert m.walk_node.depth == 4 and m.walk_node.host_only
    with pytest.raises(LockError, match="host-only"):
        tr.t.inc_lock_ref(m.walk_node)
    back = tr.put([1, 2, 3, 4], state=False)
    assert back.prefix_len == 4 and tr.t.host_only_count == 0
    incoming = tr.last_values[2:].tolist()
    assert tr.t.match_prefix([1, 2, 3, 4]).indices.tolist()[2:] == incoming  # the tree took them
    tr.t.check_invariants()


def test_host_only_leaves_go_when_their_state_goes_and_bare_parents_follow():
    tr = Tree()
    tr.put([1, 2], state=False)
    tr.put([1, 2, 3, 4])
    tr.t.evict({"full": 10})  # [3, 4] kept host-only (its state), then [1, 2] (a host-only child)
    assert tr.t.total_size() == 0 and tr.t.host_only_count == 2
    assert tr.t.evict({"state": 1}) == {"full": 0, "state": 1}
    assert tr.t.host_only_count == 0 and not list(tr.t.nodes())
    tr.t.check_invariants()


def test_evict_rejects_unknown_components_and_bad_amounts_unchanged():
    tr = Tree()
    tr.put([1, 2, 3])
    before = tr.t.sizes()
    bads: list[dict] = [{"swa": 1}, {"state": -1}, {"full": 1.5}]
    for bad in bads:
        with pytest.raises(ValueError):
            tr.t.evict(bad)
    with pytest.raises(ValueError, match="payload"):
        tr.t.insert([4, 5], np.array([9, 10], np.int32), payloads={"mamba": 1})
    assert tr.t.sizes() == before and tr.t.evict(1) == 3  # the plain preset still returns an int


def test_sizes_per_component_and_reset_frees_every_resource():
    tr = Tree()
    tr.put([1, 2, 3])
    tr.put([1, 2, 4])
    assert tr.t.sizes() == {"full": ComponentSizes(4, 0), "state": ComponentSizes(2, 0)}
    assert tr.t.evictable_size("state") == 2 and tr.t.protected_size("state") == 0
    tr.t.reset()
    assert tr.pool.available_size() == tr.pool.capacity and tr.t.total_size("state") == 0
    with pytest.raises(KeyError, match="no component"):
        tr.t.total_size("swa")


def test_component_names_must_be_unique():
    class Full(TreeComponent):
        name = "full"

    from kvjax import ConfigError

    with pytest.raises(ConfigError):
        RadixCache(components=[Full()])


def test_full_only_tree_calls_no_hook():
    t = RadixCache()
    assert not t.has_components and [c.name for c in t.components] == ["full"]
    t.insert([1, 2, 3], np.array([1, 2, 3], np.int32))
    m = t.match_prefix([1, 2, 3])
    assert m.extras == {} and m.full_kv_hit_length == 3 and m.walk_node is m.last_node


def test_request_lifecycle_runs_through_the_hooks():
    """Chunked prefill, decode and finish on a tree with a component: the lifecycle inserts call
    the hooks (no payloads yet), the match is state-limited, every invariant holds."""
    from tests.radix._helpers import Harness

    pool = StatePool(4)
    h = Harness(page_size=2, size=64, components=[StateSlotComponent(pool)])
    a = h.start([1, 2, 3, 4, 5])
    h.tree.cache_unfinished_req(a)
    h.decode(a, [6, 7])
    h.tree.cache_unfinished_req(a)
    h.finish(a)
    m = h.tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (m.prefix_len, m.full_kv_hit_length) == (0, 6)  # no state donated: nothing usable
    assert h.tree.sizes()["state"] == ComponentSizes(0, 0) and pool.available_size() == 4
    h.check()
    assert h.alloc.available_size() + h.tree.total_size() == h.capacity
