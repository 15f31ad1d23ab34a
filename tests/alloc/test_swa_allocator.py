"""SWATokenToKVPoolAllocator: scenarios with exact ids, bad input, and a small state machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError
from tests.alloc.test_allocator_scenarios import got


def snapshot(a: SWATokenToKVPoolAllocator) -> tuple:
    f, s = a.full_attn_allocator, a.swa_attn_allocator
    return (
        f.free_pages.tolist(),
        s.free_pages.tolist(),
        f.release_pages.tolist(),
        s.release_pages.tolist(),
        a.full_to_swa_index_mapping.tolist(),
        a.available_size(),
    )


# --------------------------------------------------------------------------- SGLang's unit test


def test_sglang_swa_unittest_sizes():
    # test_swa_unittest: size = size_swa = 16; the sum of available sizes is 32, then 30 after alloc(1).
    a = SWATokenToKVPoolAllocator(16, 16, 1)
    assert a.full_available_size() + a.swa_available_size() == 32
    slot = got(a.alloc(1))
    assert a.full_available_size() + a.swa_available_size() == 30
    assert a.translate_loc_from_full_to_swa(slot).tolist() == [1]
    a.free_swa(slot)
    assert a.swa_available_size() == 16 and a.full_available_size() == 15
    a.check_invariants()


# --------------------------------------------------------------------------- page size 1


def test_page1_pairs_slots_and_sizes():
    a = SWATokenToKVPoolAllocator(10, 6, 1)
    assert (a.size, a.size_full, a.size_swa) == (6, 10, 6)
    assert a.full_to_swa_index_mapping.shape == (12,)
    assert a.full_to_swa_index_mapping[-1] == -1
    x = got(a.alloc(4))
    assert x.tolist() == [1, 2, 3, 4]
    assert a.translate_loc_from_full_to_swa(x).tolist() == [1, 2, 3, 4]
    assert a.translate_loc_from_full_to_swa([-1]).tolist() == [-1]
    assert (a.full_available_size(), a.swa_available_size(), a.available_size()) == (6, 2, 2)
    a.free_swa(np.array([1, 2]))  # out of the window: the SWA part goes, the full part stays
    assert a.translate_loc_from_full_to_swa(x).tolist() == [0, 0, 3, 4]
    assert a.swa_attn_allocator.free_pages.tolist() == [5, 6, 1, 2]  # FIFO
    y = got(a.alloc(2))
    assert y.tolist() == [5, 6]
    assert a.translate_loc_from_full_to_swa(y).tolist() == [5, 6]
    a.free(x)  # full slots 1..4; only 3, 4 still have SWA slots
    assert a.full_attn_allocator.free_pages.tolist() == [7, 8, 9, 10, 1, 2, 3, 4]
    assert a.swa_attn_allocator.free_pages.tolist() == [1, 2, 3, 4]
    assert a.translate_loc_from_full_to_swa(x).tolist() == [0, 0, 0, 0]
    a.check_invariants()


def test_alloc_returns_none_when_either_side_is_short_and_changes_nothing():
    a = SWATokenToKVPoolAllocator(10, 3, 1)
    before = snapshot(a)
    assert a.alloc(4) is None  # the SWA side has 3
    assert a.alloc_extend([0], [4], [-1]) is None
    assert snapshot(a) == before
    got(a.alloc(3))
    assert a.alloc_decode([4], [3]) is None
    a.check_invariants()


def test_alloc_decode_page1_after_window_freeing():
    a = SWATokenToKVPoolAllocator(16, 8, 1)
    x = got(a.alloc_extend([0], [5], [-1]))
    assert x.tolist() == [1, 2, 3, 4, 5]
    a.free_swa(x[:3])
    d = got(a.alloc_decode([6], [5]))
    assert d.tolist() == [6]
    assert a.translate_loc_from_full_to_swa(d).tolist() == [6]
    a.check_invariants()


# --------------------------------------------------------------------------- pages


def test_paged_extend_and_decode_mirror_layout_on_both_sides():
    a = SWATokenToKVPoolAllocator(8 * 4, 4 * 4, 4)
    x = got(a.alloc_extend([0], [6], [-1]))  # pages 1, 2 on both sides
    assert x.tolist() == [4, 5, 6, 7, 8, 9]
    assert a.translate_loc_from_full_to_swa(x).tolist() == [4, 5, 6, 7, 8, 9]
    d = got(a.alloc_decode([7], [9]))  # continues page 2
    assert d.tolist() == [10]
    assert a.translate_loc_from_full_to_swa(d).tolist() == [10]
    # A second request takes page 3 on each side.
    y = got(a.alloc_extend([0], [2], [-1]))
    assert y.tolist() == [12, 13]
    # Out of the window: the first page of request 1 leaves the SWA pool.
    a.free_swa(np.array([5]))  # any slot of the page frees the whole page
    assert a.translate_loc_from_full_to_swa(x).tolist() == [0, 0, 0, 0, 8, 9]
    assert a.swa_attn_allocator.free_pages.tolist() == [1, 4]  # LIFO: the freed page first
    # Request 1 continues on a fresh page: full page 4 pairs with SWA page 1.
    e = got(a.alloc_extend([8], [9], [11]))
    assert e.tolist() == [16]
    assert a.translate_loc_from_full_to_swa(e).tolist() == [4]
    a.check_invariants()
    a.free(x)  # full pages 1 and 2; SWA page 2 only (page 1's SWA part is gone)
    assert a.full_attn_allocator.free_pages.tolist() == [1, 2, 5, 6, 7, 8]
    assert a.swa_attn_allocator.free_pages.tolist() == [2, 4]
    a.check_invariants()


def test_paged_extend_after_window_freed_last_page_of_aligned_prefix():
    # A page-aligned prefix whose SWA part is entirely gone continues on fresh SWA pages.
    a = SWATokenToKVPoolAllocator(8 * 2, 4 * 2, 2)
    x = got(a.alloc_extend([0], [4], [-1]))  # full pages 1, 2 / SWA pages 1, 2
    a.free_swa(x)
    out = got(a.alloc_extend([4], [7], [int(x[-1])]))
    assert out.tolist() == [6, 7, 8]  # full pages 3, 4
    assert a.translate_loc_from_full_to_swa(out).tolist() == [2, 3, 4]  # SWA pages 1, 2 (LIFO: 1 first)
    a.check_invariants()


# --------------------------------------------------------------------------- bad input


def test_bad_input_raises_and_changes_nothing():
    a = SWATokenToKVPoolAllocator(8 * 2, 4 * 2, 2)
    x = got(a.alloc_extend([0], [3], [-1]))  # full slots 2, 3, 4
    a.free_swa(x[:2])  # page 1's SWA part
    before = snapshot(a)
    with pytest.raises(DoubleFreeError, match=r"SWA part of full pages \[1\]"):
        a.free_swa(x[:1])
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free_swa([18])
    with pytest.raises(InvalidSlotError, match="not in use"):
        a.free_swa([6])  # page 3 is free
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free([99])
    with pytest.raises(DoubleFreeError):
        a.free([10])  # page 5 is free
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.translate_loc_from_full_to_swa([18])
    with pytest.raises(InvalidSlotError, match="not a multiple"):
        a.alloc(3)
    with pytest.raises(InvalidSlotError, match="last_loc"):
        a.alloc_extend([3], [4], [7])  # last_loc on a free page
    assert snapshot(a) == before
    # A partial page whose SWA part was freed cannot be continued.
    y = got(a.alloc_extend([0], [1], [-1]))  # full page 3, SWA page 1
    a.free_swa(y)
    before = snapshot(a)
    with pytest.raises(InvalidSlotError, match="partial page"):
        a.alloc_extend([1], [2], [int(y[0])])
    with pytest.raises(InvalidSlotError, match="partial page"):
        a.alloc_decode([2], [int(y[0])])
    assert snapshot(a) == before
    a.check_invariants()


def test_config_errors_name_the_side():
    with pytest.raises(ConfigError, match="size_swa"):
        SWATokenToKVPoolAllocator(16, -1, 1)
    with pytest.raises(ConfigError, match="page_size"):
        SWATokenToKVPoolAllocator(16, 16, 0)


def test_free_group_backup_restore_and_clear():
    a = SWATokenToKVPoolAllocator(12, 6, 1)
    x = got(a.alloc(3))
    state = a.backup_state()
    y = got(a.alloc(2))
    a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.full_available_size() == 7 and a.swa_available_size() == 1  # buffered
    a.check_invariants()
    a.free_group_end()
    assert a.full_available_size() == 12 and a.swa_available_size() == 6
    a.check_invariants()
    a.restore_state(state)
    assert a.translate_loc_from_full_to_swa(x).tolist() == [1, 2, 3]
    assert a.translate_loc_from_full_to_swa(y).tolist() == [0, 0]
    assert a.full_available_size() == 9
    a.check_invariants()
    a.clear()
    assert a.available_size() == 6 and not a.full_to_swa_index_mapping[:-1].any()
    a.check_invariants()


def test_device_mapping_follows_changes():
    a = SWATokenToKVPoolAllocator(8, 8, 1)
    d0 = a.device_mapping()
    assert a.device_mapping() is d0  # cached while unchanged
    x = got(a.alloc(2))
    d1 = a.device_mapping()
    assert np.asarray(d1)[x].tolist() == [1, 2]
    assert np.asarray(d1)[-1] == -1


# --------------------------------------------------------------------------- state machine


class SWAAllocatorMachine(RuleBasedStateMachine):
    """Requests grow (extend/decode), leave their window (free_swa behind it) and finish; the
    model tracks each request's full slots and which of them still hold an SWA slot."""

    @initialize(ps=st.sampled_from([1, 2]), full_pages=st.integers(4, 12), swa_pages=st.integers(2, 8))
    def setup(self, ps: int, full_pages: int, swa_pages: int) -> None:
        self.ps = ps
        self.a = SWATokenToKVPoolAllocator(full_pages * ps, swa_pages * ps, ps)
        self.reqs: dict[int, list[int]] = {}
        self.swa_from: dict[int, int] = {}  # tokens [0, swa_from) of a request have no SWA slot
        self.next_id = 0

    def live_full(self) -> list[int]:
        return [s for slots in self.reqs.values() for s in slots]

    @rule(n=st.integers(1, 6))
    def new_request(self, n: int) -> None:
        before = snapshot(self.a)
        out = self.a.alloc_extend([0], [n], [-1])
        if out is None:
            assert snapshot(self.a) == before
            return
        assert len(out) == n and not set(out.tolist()) & set(self.live_full())
        self.reqs[self.next_id] = out.tolist()
        self.swa_from[self.next_id] = 0
        self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 4))
    def extend(self, data: st.DataObject, n: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs[rid]
        pre = len(slots)
        if self.swa_from[rid] >= pre and pre % self.ps:
            return  # its partial last page has no SWA slot: refused (tested in the scenarios)
        before = snapshot(self.a)
        out = (
            self.a.alloc_decode([pre + 1], [slots[-1]])
            if n == 1
            else self.a.alloc_extend([pre], [pre + n], [slots[-1]])
        )
        if out is None:
            assert snapshot(self.a) == before
            return
        assert not set(out.tolist()) & set(self.live_full())
        if pre % self.ps:
            assert out[0] == slots[-1] + 1  # continues the partial page
        slots.extend(out.tolist())

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def leave_window(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs[rid]
        lo = self.swa_from[rid]
        hi = (len(slots) // self.ps) * self.ps  # whole pages only
        if hi <= lo:
            return
        hi = data.draw(st.integers(lo + self.ps, hi).filter(lambda h: h % self.ps == 0))
        self.a.free_swa(slots[lo:hi])
        self.swa_from[rid] = hi
        with pytest.raises(DoubleFreeError):
            self.a.free_swa(slots[lo : lo + 1])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs.pop(rid)
        del self.swa_from[rid]
        self.a.free(slots)
        with pytest.raises(DoubleFreeError):
            self.a.free(slots[:1])

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "a"):
            return
        a = self.a
        a.check_invariants()
        held_full = sum(-(-len(s) // self.ps) for s in self.reqs.values()) * self.ps
        assert a.full_available_size() + held_full == a.size_full
        held_swa = 0
        for rid, slots in self.reqs.items():
            m = a.translate_loc_from_full_to_swa(slots) if slots else np.zeros(0, np.int64)
            lo = self.swa_from[rid]
            assert not m[:lo].any() and (m[lo:] > 0).all()
            held_swa += -(-len(slots) // self.ps) - lo // self.ps
        assert a.swa_available_size() + held_swa * self.ps == a.size_swa


SWAAllocatorMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSWAAllocatorMachine = SWAAllocatorMachine.TestCase


def test_move_swa_pairing_for_locked_full_recovery():
    a = SWATokenToKVPoolAllocator(16, 8, 1)
    old = got(a.alloc(2))  # the tree's locked full slots 1, 2 ...
    a.free_swa(old)  # ... whose SWA part was evicted (a tombstone)
    new = got(a.alloc(2))  # an insert's fresh copy: full 3, 4 paired with SWA 3, 4
    before = snapshot(a)
    with pytest.raises(InvalidSlotError, match="without an SWA slot"):
        a.move_swa_pairing(old, new)
    with pytest.raises(InvalidSlotError, match="already paired"):
        a.move_swa_pairing(new, new)
    assert snapshot(a) == before
    a.move_swa_pairing(new, old)
    assert a.translate_loc_from_full_to_swa(old).tolist() == [3, 4]
    a.free(new)  # only the full part goes
    assert a.swa_available_size() == 6 and a.full_available_size() == 14
    a.check_invariants()


def test_pages_pair_whole_so_a_continued_page_is_paired_before_its_write():
    a = SWATokenToKVPoolAllocator(8 * 4, 4 * 4, 4)
    a.alloc(4)  # SWA page 1 taken by another request: the sides now differ
    a.free_swa(np.arange(4, 8))
    x = got(a.alloc_extend([0], [6], [-1]))  # full pages 2, 3 / SWA pages 1, 2
    assert x.tolist() == [8, 9, 10, 11, 12, 13]
    # slots 14, 15 (the rest of full page 3) are paired already: decode may write at last + 1
    assert a.translate_loc_from_full_to_swa([14, 15]).tolist() == [10, 11]
    a.check_invariants()


def test_evict_to_free_tokens_asks_the_tree_per_side():
    class Tree:
        asked: list = []

        def evict(self, amounts):
            self.asked.append(dict(amounts))
            return {"full": 0, "swa": 0}

    a = SWATokenToKVPoolAllocator(16, 4, 1)
    got(a.alloc(3))
    t = Tree()
    assert a.evict_to_free_tokens(t, 2) == 0 and t.asked == [{"full": 0, "swa": 1}]
    assert a.evict_to_free_tokens(t, 1) == 0 and len(t.asked) == 1  # enough room: nothing asked


# --------------------------------------------------------------------------- row segments


def test_free_segment_and_free_swa_segment_keep_row_order_on_both_sides():
    a = SWATokenToKVPoolAllocator(16, 16, 2)
    got(a.alloc(2))  # full page 1 / SWA page 1 stay in use
    x = got(a.alloc(6))  # full pages 2, 3, 4
    mapped = a.full_to_swa_index_mapping[x].copy()
    seg = np.concatenate([x[4:], x[:4]])  # full pages 4, 2, 3
    a.free_swa_segment(seg[:2], start_pos=0)  # SWA part of full page 4 only (a tombstone)
    assert a.swa_attn_allocator.free_pages.tolist()[0] == int(mapped[4]) // 2
    before = snapshot(a)
    with pytest.raises(DoubleFreeError, match="already freed"):
        a.free_swa_segment(seg[:2], start_pos=0)
    with pytest.raises(InvalidSlotError, match="not page aligned"):
        a.free_swa_segment(seg[2:], start_pos=1)
    with pytest.raises(InvalidSlotError, match="not page aligned"):
        a.free_segment(seg, start_pos=3)
    assert snapshot(a) == before
    a.free_segment(seg, start_pos=0)  # full pages 4, 2, 3; SWA: only 2's and 3's pairs are left
    assert a.full_attn_allocator.free_pages.tolist()[:3] == [4, 2, 3]
    swa_pages = (mapped[[0, 2]] // 2).tolist()
    assert a.swa_attn_allocator.free_pages.tolist()[:2] == swa_pages
    assert not a.full_to_swa_index_mapping[x].any()
    a.check_invariants()
