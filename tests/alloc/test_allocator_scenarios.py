"""Scenario tests with exact slot ids: SGLang's allocator contract (test_allocator_cpu.py)."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import pytest

from kvjax.alloc import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    make_allocator,
)
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError

T = TypeVar("T")


def got(result: T | None) -> T:
    """An allocation's result, failing the test when it returned None."""
    assert result is not None, "the allocation returned None"
    return result


def snapshot(a: BaseTokenToKVPoolAllocator) -> tuple:
    """Everything observable about an allocator's state."""
    return (
        a.free_pages.tolist(),
        a.release_pages.tolist(),
        a.free_mask.tolist(),
        a.pending_mask.tolist(),
        a.available_size(),
        a.used_size(),
    )


def arrange_free_list(a: PagedTokenToKVPoolAllocator, pages: list[int]) -> None:
    """Allocate every page, then free ``pages`` so the free list is exactly ``pages``."""
    a.alloc(a.size)
    for p in reversed(pages):  # each free prepends
        a.free(np.array([p * a.page_size]))
    assert a.free_pages.tolist() == pages


# --------------------------------------------------------------------------- alloc_extend vectors

PS = 4
PREFIX_PAGE = 1  # SGLang's vectors put prefixes on page 0, which kvjax never hands out


def token_or_paged(kind: str, pages: int, *, need_sort: bool = False) -> BaseTokenToKVPoolAllocator:
    """A ``"token"`` allocator of ``pages`` slots, or a ``"paged"`` one of ``pages`` pages of ``PS``."""
    if kind == "token":
        return TokenToKVPoolAllocator(pages, need_sort=need_sort)
    return PagedTokenToKVPoolAllocator(pages * PS, PS, need_sort=need_sort)


def first_page_freed(kind: str) -> tuple[BaseTokenToKVPoolAllocator, np.ndarray]:
    """A 16-page allocator of ``kind`` and the slots ``x`` of 4 pages it handed out, the first of
    which is free again (to free twice)."""
    a = token_or_paged(kind, 16)
    x = got(a.alloc(4 * a.page_size))
    a.free(x[: a.page_size])
    return a, x


def shift(slots: list[int]) -> list[int]:
    """Move slots of page 0 (SGLang's test prefixes) to ``PREFIX_PAGE``."""
    return [s + PREFIX_PAGE * PS if s < PS else s for s in slots]


# prefix, seq, last_loc, free pages, expected output: SGLang's alloc_extend_naive table.
EXTEND_VECTORS = [
    (2, 4, 1, [], [2, 3]),
    (0, 8, -1, [5, 6], list(range(20, 28))),
    (4, 7, 3, [3], [12, 13, 14]),
    (2, 8, 1, [3], [2, 3, 12, 13, 14, 15]),
    (2, 7, 1, [3], [2, 3, 12, 13, 14]),
    (4, 11, 3, [2, 3], [8, 9, 10, 11, 12, 13, 14]),
    (2, 11, 1, [3, 4], [2, 3, 12, 13, 14, 15, 16, 17, 18]),
]


@pytest.mark.parametrize("prefix,seq,last_loc,free,expected", EXTEND_VECTORS)
def test_alloc_extend_sglang_vectors(prefix, seq, last_loc, free, expected):
    a = PagedTokenToKVPoolAllocator(16 * PS, PS)
    arrange_free_list(a, free)
    last = last_loc if last_loc < 0 else shift([last_loc])[0]
    out = got(a.alloc_extend(np.array([prefix]), np.array([seq]), np.array([last])))
    assert out.dtype == np.int32
    assert out.tolist() == shift(expected)
    assert a.free_pages.tolist() == []
    a.check_invariants()


def test_alloc_extend_within_partial_page_takes_no_page():
    a = PagedTokenToKVPoolAllocator(16 * PS, PS)
    a.alloc(PS)  # page 1
    out = got(a.alloc_extend([1], [3], [PS]))
    assert out.tolist() == [5, 6]
    assert a.free_pages.tolist() == list(range(2, 17))


def test_alloc_extend_zero_extend_and_several_requests():
    a = PagedTokenToKVPoolAllocator(16 * PS, PS)
    p = got(a.alloc(2 * PS))  # pages 1, 2
    assert got(a.alloc_extend([0], [0], [-1])).tolist() == []
    out = got(a.alloc_extend([0, 5, 3, 8], [6, 5, 9, 9], [-1, int(p[4]), int(p[2]), int(p[7])]))
    # request 0: pages 3 (full) + 4 (2 slots); request 1: nothing; request 2: slot 3 of page 1,
    # then page 5 (full) + page 6 (1 slot); request 3: page 7 (1 slot).
    assert out.tolist() == [12, 13, 14, 15, 16, 17, 7, 20, 21, 22, 23, 24, 28]
    assert len(set(out.tolist())) == out.size == 6 + 0 + 6 + 1


def test_alloc_extend_out_of_pages_leaves_state_unchanged():
    a = PagedTokenToKVPoolAllocator(4 * PS, PS)
    before = snapshot(a)
    assert a.alloc_extend([0, 0], [8, 9], [-1, -1]) is None
    assert snapshot(a) == before
    assert got(a.alloc_extend([0], [16], [-1])).tolist() == list(range(4, 20))


def test_alloc_extend_rejects_inconsistent_last_loc():
    a = PagedTokenToKVPoolAllocator(16 * PS, PS)
    p = got(a.alloc(PS))
    before = snapshot(a)
    with pytest.raises(InvalidSlotError, match="request 1"):
        a.alloc_extend([0, 2], [4, 5], [-1, int(p[2])])  # (last+1) % 4 = 3 != 2
    with pytest.raises(InvalidSlotError, match="request 0.*-1"):
        a.alloc_extend([0], [4], [5])
    with pytest.raises(InvalidSlotError, match="request 0"):
        a.alloc_extend([2], [4], [1])  # prefix on the trash page: never allocated in kvjax
    with pytest.raises(InvalidSlotError, match="free"):
        a.alloc_extend([2], [4], [2 * PS + 1])  # page 2 is free
    with pytest.raises(InvalidSlotError, match="request 0"):
        a.alloc_extend([5], [4], [-1])
    with pytest.raises(InvalidSlotError, match="extend_num_tokens"):
        a.alloc_extend([0], [4], [-1], extend_num_tokens=5)
    with pytest.raises(InvalidSlotError):
        a.alloc_extend([0, 0], [4], [-1])
    assert snapshot(a) == before


def test_alloc_decode():
    a = PagedTokenToKVPoolAllocator(16 * PS, PS)
    p = got(a.alloc(2 * PS))  # pages 1, 2
    # seq 5: token 4 starts a page; seq 3: continues page 1 after slot 5; seq 1: empty prefix.
    out = got(a.alloc_decode([5, 3, 1], [int(p[3]), int(p[1]), -1]))
    assert out.tolist() == [12, 6, 16]
    assert a.free_pages.tolist()[:1] == [5]
    before = snapshot(a)
    with pytest.raises(InvalidSlotError, match="request 0"):
        a.alloc_decode([3], [int(p[2])])
    assert snapshot(a) == before
    small = PagedTokenToKVPoolAllocator(PS, PS)
    small.alloc(PS)
    assert small.alloc_decode([1], [-1]) is None


def test_token_allocator_extend_and_decode_work():
    a = TokenToKVPoolAllocator(16)
    first = got(a.alloc(3))
    assert got(a.alloc_extend([0, 3], [2, 5], [-1, int(first[-1])])).tolist() == [4, 5, 6, 7]
    assert got(a.alloc_decode([6, 1], [7, -1])).tolist() == [8, 9]
    a.check_invariants()


# --------------------------------------------------------------------------- token allocator


def test_token_alloc_basic_and_fifo_reuse():
    a = TokenToKVPoolAllocator(8)
    assert (a.size, a.page_size, a.num_pages) == (8, 1, 8)
    x = got(a.alloc(3))
    assert x.dtype == np.int32 and x.tolist() == [1, 2, 3]
    assert a.available_size() == 5 and a.used_size() == 3
    a.free(np.array([2, 1]))
    assert a.free_pages.tolist() == [4, 5, 6, 7, 8, 2, 1]  # appended at the end: FIFO
    assert got(a.alloc(6)).tolist() == [4, 5, 6, 7, 8, 2]
    a.check_invariants()


def test_token_exact_capacity_then_none_and_alloc_zero():
    for need_sort in (False, True):
        a = TokenToKVPoolAllocator(8, need_sort=need_sort)
        before = snapshot(a)
        assert got(a.alloc(0)).tolist() == []
        assert snapshot(a) == before
        x = got(a.alloc(8))
        assert sorted(x.tolist()) == list(range(1, 9)) and 0 not in x
        assert a.alloc(1) is None
        a.free(x[:2])
        assert a.alloc(3) is None  # even after the merge the need_sort path does
        assert a.alloc(2) is not None


def test_token_need_sort_release_and_merge():
    a = TokenToKVPoolAllocator(8, need_sort=True)
    a.alloc(6)
    a.free([5, 2, 4])
    assert a.release_pages.tolist() == [5, 2, 4]
    assert a.free_pages.tolist() == [7, 8]
    assert a.available_size() == 5
    assert got(a.alloc(2)).tolist() == [7, 8]  # enough in the free list: no merge
    assert got(a.alloc(2)).tolist() == [2, 4]  # merged and sorted
    assert a.release_pages.tolist() == [] and a.free_pages.tolist() == [5]
    a.check_invariants()


def test_merge_and_sort_free_noop_and_sorted():
    a = PagedTokenToKVPoolAllocator(8 * PS, PS, need_sort=True)
    before = snapshot(a)
    a.merge_and_sort_free()
    assert snapshot(a) == before
    x = got(a.alloc(8 * PS))
    a.free(x[5 * PS :])
    a.free(x[:PS])
    assert a.release_pages.tolist() == [1, 6, 7, 8]
    a.merge_and_sort_free()
    assert a.free_pages.tolist() == [1, 6, 7, 8] and a.release_pages.tolist() == []


def test_free_empty_is_noop():
    for a in (TokenToKVPoolAllocator(8), PagedTokenToKVPoolAllocator(8 * PS, PS)):
        a.alloc(a.page_size)
        before = snapshot(a)
        a.free(np.zeros(0, np.int32))
        a.free([])
        assert snapshot(a) == before


# --------------------------------------------------------------------------- paged allocator


def test_paged_alloc_alignment_and_lifo_reuse():
    a = PagedTokenToKVPoolAllocator(8 * PS, PS)
    assert (a.size, a.num_pages) == (32, 8)
    x = got(a.alloc(3 * PS))
    assert x.tolist() == list(range(4, 16))
    assert x[0] % PS == 0 and x[PS] % PS == 0 and 0 not in x
    with pytest.raises(InvalidSlotError, match="multiple of page_size"):
        a.alloc(3)
    a.free(x[PS : 2 * PS])  # page 2
    a.free(np.array([15, 4, 13]))  # pages 3 and 1, several ids per page
    assert a.free_pages.tolist() == [1, 3, 2, 4, 5, 6, 7, 8]  # prepended: LIFO
    assert got(a.alloc(PS)).tolist() == [4, 5, 6, 7]
    a.check_invariants()


def test_paged_exact_capacity_then_none():
    for need_sort in (False, True):
        a = PagedTokenToKVPoolAllocator(4 * PS + 3, PS, need_sort=need_sort)
        assert a.size == 4 * PS
        x = got(a.alloc(4 * PS))
        assert x.min() >= PS
        assert a.alloc(PS) is None
        a.free(x)
        assert a.alloc(4 * PS) is not None


def test_make_allocator_picks_class():
    assert type(make_allocator(16, 1)) is TokenToKVPoolAllocator
    p = make_allocator(16, 4, need_sort=True)
    assert type(p) is PagedTokenToKVPoolAllocator and p.need_sort
    with pytest.raises(ConfigError):
        make_allocator(16, 0)
    with pytest.raises(ConfigError):
        TokenToKVPoolAllocator(-1)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kind", ["token", "paged"])
def test_bad_frees_raise_and_leave_state_unchanged(kind):
    a, x = first_page_freed(kind)
    ps = a.page_size
    before = snapshot(a)
    with pytest.raises(DoubleFreeError, match=str(int(x[0]) // ps)):
        a.free(x[:ps])
    with pytest.raises(InvalidSlotError, match="trash page"):
        a.free([0])
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free([int(x[-1]), -1])
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free([17 * ps])
    with pytest.raises(InvalidSlotError):
        a.free([1.5])
    assert snapshot(a) == before
    # A mix of live and already-free ids frees nothing.
    with pytest.raises(DoubleFreeError):
        a.free(np.concatenate([x[ps:], x[:1]]))
    assert snapshot(a) == before


def test_token_duplicate_within_one_call():
    a = TokenToKVPoolAllocator(8)
    a.alloc(4)
    before = snapshot(a)
    with pytest.raises(DoubleFreeError, match=r"\[3\]"):
        a.free([1, 3, 2, 3])
    assert snapshot(a) == before


def test_error_message_lists_few_ids_and_count():
    a = TokenToKVPoolAllocator(64)
    with pytest.raises(DoubleFreeError, match=r"\.\.\.\] \(20 ids\)"):
        a.free(np.arange(1, 21))


# --------------------------------------------------------------------------- groups, backup


@pytest.mark.parametrize("kind", ["token", "paged"])
def test_free_group_defers(kind):
    a = token_or_paged(kind, 16)
    ps = a.page_size
    x = got(a.alloc(6 * ps))
    avail = a.available_size()
    a.free_group_begin()
    a.free_group_end()  # empty group
    a.free_group_begin()
    with pytest.raises(RuntimeError):
        a.free_group_begin()
    a.free(x[4 * ps :])
    a.free(x[:ps])
    assert a.available_size() == avail
    a.check_invariants()
    with pytest.raises(DoubleFreeError):
        a.free(x[:1])  # pending in the group counts as freed
    with pytest.raises(RuntimeError):
        a.restore_state(a.backup_state())
    a.free_group_end()
    assert a.available_size() == avail + 3 * ps
    if kind == "token":
        assert a.free_pages.tolist()[-3:] == [5, 6, 1]
    else:
        assert a.free_pages.tolist()[:3] == [1, 5, 6]
    with pytest.raises(RuntimeError):
        a.free_group_end()
    a.check_invariants()


@pytest.mark.parametrize("kind", ["token", "paged"])
def test_backup_restore_is_a_snapshot(kind):
    a = (
        TokenToKVPoolAllocator(16, need_sort=True)
        if kind == "token"
        else PagedTokenToKVPoolAllocator(16 * PS, PS, need_sort=True)
    )
    ps = a.page_size
    x = got(a.alloc(4 * ps))
    a.free(x[:ps])
    state = a.backup_state()
    before = snapshot(a)
    y = got(a.alloc(10 * ps))
    a.free(x[ps:])
    a.free(y)
    assert snapshot(a) != before
    a.restore_state(state)
    assert snapshot(a) == before
    a.check_invariants()
    # The snapshot is not aliased by the allocator: using it twice works.
    a.alloc(12 * ps)
    a.restore_state(state)
    assert snapshot(a) == before
    with pytest.raises(ValueError):
        state.free_pages[0] = 3
    with pytest.raises(InvalidSlotError):
        make_allocator(32, 2).restore_state(state)


def test_clear_resets_everything():
    a = PagedTokenToKVPoolAllocator(8 * PS, PS, need_sort=True)
    x = got(a.alloc(4 * PS))
    a.free(x[:PS])
    a.free_group_begin()
    a.free(x[PS:])
    a.clear()
    fresh = PagedTokenToKVPoolAllocator(8 * PS, PS, need_sort=True)
    assert snapshot(a) == snapshot(fresh)
    a.free_group_begin()  # the group was closed by clear
    a.free_group_end()
    a.check_invariants()


def test_alloc_cost_does_not_grow_with_pool():
    """Functional side of the O(k) claim: a 1M-page pool allocates from its head quickly."""
    a = PagedTokenToKVPoolAllocator((1 << 20) * 16, 16)
    x = got(a.alloc(256 * 16))
    assert x[:3].tolist() == [16, 17, 18] and x.size == 4096
    a.free(x)
    assert a.free_pages[:2].tolist() == [1, 2]


def test_need_sort_merges_before_returning_none_as_sglang_0_5_23():
    """0.5.23 merges the release list into the free list before giving up, in every alloc path."""
    a = PagedTokenToKVPoolAllocator(8 * PS, PS, need_sort=True)
    x = got(a.alloc(6 * PS))  # pages 1..6; free: 7, 8
    a.free(x[:PS])  # page 1 to the release list
    assert a.alloc(4 * PS) is None  # 4 > 2 free pages: merged, then still too few
    assert a.free_pages.tolist() == [1, 7, 8] and a.release_pages.tolist() == []
    assert a.available_size() == 3 * PS
    a.check_invariants()


def test_need_sort_alloc_decode_merges_when_the_batch_exceeds_the_free_pages():
    a = PagedTokenToKVPoolAllocator(8 * PS, PS, need_sort=True)
    x = got(a.alloc(7 * PS))  # pages 1..7; free: 8
    a.free(x[2 * PS : 3 * PS])  # page 3 released
    # Two requests mid-page need no new page, but the batch (2) exceeds the free list (1): merged.
    out = got(a.alloc_decode([2, 2], [int(x[0]), int(x[PS])]))
    assert out.tolist() == [int(x[0]) + 1, int(x[PS]) + 1]
    assert a.free_pages.tolist() == [3, 8] and a.release_pages.tolist() == []
    # A batch of one within the free list does not merge.
    a.free(x[3 * PS : 4 * PS])  # page 4 released
    a.alloc_decode([1], [-1])
    assert a.release_pages.tolist() == [4] and a.free_pages.tolist() == [8]
    a.check_invariants()


def test_need_sort_alloc_extend_merges_on_the_sglang_estimate():
    a = PagedTokenToKVPoolAllocator(8 * PS, PS, need_sort=True)
    x = got(a.alloc(5 * PS))  # pages 1..5; free: 6, 7, 8
    a.free(x[:PS])  # page 1 released
    # One new page needed (3 free), but extend // page + batch + 1 = 1 + 1 + 1 = 3 is not > 3: no merge.
    out = got(a.alloc_extend([0], [PS], [-1]))
    assert out.tolist() == list(range(6 * PS, 7 * PS)) and a.release_pages.tolist() == [1]
    # Now 2 free: the same call's estimate 3 > 2 merges, and the sorted head (page 1) is used.
    out = got(a.alloc_extend([0], [PS], [-1]))
    assert out.tolist() == list(range(1 * PS, 2 * PS))
    assert a.free_pages.tolist() == [7, 8] and a.release_pages.tolist() == []
    # Too few pages (4 > 3): the merge still happens before None.
    a.free(x[PS : 2 * PS])  # page 2 released
    assert a.alloc_extend([0], [4 * PS], [-1]) is None
    assert a.free_pages.tolist() == [2, 7, 8] and a.release_pages.tolist() == []
    a.check_invariants()


def test_need_sort_page1_alloc_extend_merges_only_when_the_tokens_exceed_the_free_list():
    """0.5.23's page-1 extend is ``alloc(total)``: the release list is merged only when the
    tokens exceed the free list, not on the paged estimate ``total // page + batch + 1``."""
    a = TokenToKVPoolAllocator(8, need_sort=True)
    x = got(a.alloc(4))  # 1..4; free: 5..8
    a.free(x[:2])  # 1, 2 to the release list
    assert got(a.alloc_extend([0], [4], [-1])).tolist() == [5, 6, 7, 8]
    assert a.release_pages.tolist() == [1, 2]
    # Now the free list is empty: the next token merges, sorted.
    assert got(a.alloc_extend([0], [1], [-1])).tolist() == [1]
    a.check_invariants()


# --------------------------------------------------------------------------- free_segment


def test_paged_free_segment_keeps_row_order_where_free_sorts():
    """0.5.23: the tree's frees (``free_segment``) prepend a segment's pages in row order; only the
    plain ``free`` sorts (the issue's scenario: page 4, 64-token pool)."""
    a = PagedTokenToKVPoolAllocator(64, 4)
    x, y = got(a.alloc(4)), got(a.alloc(4))
    a.free(x)
    a.free(y)
    v = got(a.alloc(8))
    assert v.tolist() == [8, 9, 10, 11, 4, 5, 6, 7]
    a.free_segment(v, start_pos=0)
    assert a.free_pages.tolist()[:3] == [2, 1, 3]
    assert got(a.alloc(4)).tolist() == [8, 9, 10, 11]
    w = got(a.alloc(4))
    a.free_segment(w, start_pos=0)  # page 1 back at the head
    b = PagedTokenToKVPoolAllocator(64, 4)  # the same pages through free(): sorted
    x, y = got(b.alloc(4)), got(b.alloc(4))
    b.free(x)
    b.free(y)
    b.free(got(b.alloc(8)))
    assert b.free_pages.tolist()[:2] == [1, 2]
    a.check_invariants()
    b.check_invariants()


def test_free_segment_partial_last_page_and_token_allocator():
    a = PagedTokenToKVPoolAllocator(16 * PS, PS)
    got(a.alloc(2 * PS))  # pages 1, 2 stay in use
    p = got(a.alloc(3 * PS))  # pages 3, 4, 5
    seg = np.concatenate([p[2 * PS :], p[:PS], p[PS : PS + 2]])  # pages 5, 3, then half of 4
    a.free_segment(seg, start_pos=8)
    assert a.free_pages.tolist()[:3] == [5, 3, 4]
    a.free_segment(np.zeros(0, np.int32), start_pos=0)  # empty: a no-op
    t = TokenToKVPoolAllocator(8)
    s = got(t.alloc(4))
    t.free_segment(s[::-1], start_pos=3)  # page size 1: free(), FIFO in the given order
    assert t.free_pages.tolist() == [5, 6, 7, 8, 4, 3, 2, 1]
    a.check_invariants()
    t.check_invariants()


@pytest.mark.parametrize("kind", ["token", "paged"])
def test_free_segment_in_a_group_and_under_need_sort(kind):
    a = token_or_paged(kind, 16)
    ps = a.page_size
    x = got(a.alloc(6 * ps))
    a.free_group_begin()
    a.free(x[4 * ps :])  # pages 5, 6
    a.free_segment(np.concatenate([x[3 * ps : 4 * ps], x[: 2 * ps]]), start_pos=0)  # pages 4, 1, 2
    with pytest.raises(DoubleFreeError):
        a.free_segment(x[:ps], start_pos=0)  # pending in the group
    a.check_invariants()
    a.free_group_end()
    if kind == "token":  # one FIFO queue, in call order
        assert a.free_pages.tolist()[-5:] == [5, 6, 4, 1, 2]
    else:  # the plain frees (sorted), then the segments in front of them (SGLang's group order)
        assert a.free_pages.tolist()[:5] == [4, 1, 2, 5, 6]
    a.check_invariants()
    s = token_or_paged(kind, 8, need_sort=True)
    y = got(s.alloc(8 * s.page_size))
    s.free_segment(np.concatenate([y[5 * s.page_size : 6 * s.page_size], y[: s.page_size]]), start_pos=0)
    assert s.free_pages.tolist() == [] and sorted(s.release_pages.tolist()) == [1, 6]
    assert got(s.alloc(s.page_size)).tolist()[:1] == [s.page_size]  # merged, sorted: page 1 first
    s.check_invariants()


@pytest.mark.parametrize("kind", ["token", "paged"])
def test_free_segment_rejects_bad_input_and_changes_nothing(kind):
    a, x = first_page_freed(kind)
    ps = a.page_size
    before = snapshot(a)
    with pytest.raises(DoubleFreeError, match=r"already free.*\[1\]"):
        a.free_segment(x[: 2 * ps], start_pos=0)  # page 1 is free already
    with pytest.raises(InvalidSlotError, match="trash page"):
        a.free_segment(np.concatenate([x[ps : 2 * ps], [0]]), start_pos=0)
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free_segment([10**6], start_pos=0)
    with pytest.raises(InvalidSlotError, match="start_pos"):
        a.free_segment(x[ps:], start_pos=-1)
    if kind == "paged":
        with pytest.raises(InvalidSlotError, match="start_pos=2 is not page aligned"):
            a.free_segment(x[ps:], start_pos=2)
        seg = np.concatenate([x[ps : ps + 1], x[2 * ps : 3 * ps], x[ps + 1 : 2 * ps]])
        with pytest.raises(DoubleFreeError, match=r"two separate runs.*\[2\]"):
            a.free_segment(seg, start_pos=0)  # page 2 in two runs
    else:
        with pytest.raises(DoubleFreeError, match="more than once"):
            a.free_segment([2, 3, 2], start_pos=0)
    assert snapshot(a) == before
    a.check_invariants()
