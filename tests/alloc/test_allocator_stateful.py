"""Hypothesis state machines: every allocator call against an exact model of the free lists.

The model keeps SGLang's free list and release list as Python lists (head first) and replays
each operation's documented semantics; after every step the allocator's lists must equal the
model's, its invariants must hold, and no slot may be handed out while live.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvjax.alloc import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvjax.errors import DoubleFreeError, InvalidSlotError
from tests.alloc.naive_reference import naive_alloc_decode, naive_alloc_extend

NUM_PAGES = 24
MAX_REQ_PAGES = 6


class AllocatorMachine(RuleBasedStateMachine):
    page_size = 1
    paged = False

    @initialize(need_sort=st.booleans())
    def setup(self, need_sort: bool) -> None:
        ps = self.page_size
        self.a: BaseTokenToKVPoolAllocator
        if self.paged:
            self.a = PagedTokenToKVPoolAllocator(NUM_PAGES * ps, ps, need_sort=need_sort)
        else:
            self.a = TokenToKVPoolAllocator(NUM_PAGES, need_sort=need_sort)
        self.need_sort = need_sort
        self.free = list(range(1, NUM_PAGES + 1))
        self.release: list[int] = []
        self.group: list[list[int]] | None = None
        self.group_segments: list[list[int]] = []  # paged: segment frees of the open group
        self.reqs: dict[int, list[int]] = {}  # request id -> its slots, position order
        self.pending: set[int] = set()  # slots freed inside the open group
        self.stale: list[np.ndarray] = []  # slot arrays freed earlier
        self.next_id = 0
        self.backups: list[tuple] = []

    # ------------------------------------------------------------------ model helpers

    def live_slots(self) -> set[int]:
        return {s for slots in self.reqs.values() for s in slots} | self.pending

    def model_merge(self, estimate: int) -> None:
        """SGLang 0.5.23: under need_sort, merge (sorted) when the call's estimate exceeds the free list."""
        if self.need_sort and estimate > len(self.free):
            self.free = sorted(self.free + self.release)
            self.release = []

    def model_take(self, k: int, estimate: int | None = None) -> list[int] | None:
        self.model_merge(k if estimate is None else estimate)  # even when the call then fails
        if k > len(self.free):
            return None
        taken, self.free = self.free[:k], self.free[k:]
        return taken

    def model_give(self, pages: list[int]) -> None:
        target = "release" if self.need_sort else "free"
        lst = getattr(self, target)
        setattr(self, target, lst + pages if not self.paged else pages + lst)

    def pages_of(self, slots) -> list[int]:
        pages = [int(s) // self.page_size for s in slots]
        return sorted(set(pages)) if self.paged else pages

    def record_new(self, out: np.ndarray) -> None:
        new = out.tolist()
        assert len(set(new)) == len(new)
        assert not set(new) & self.live_slots(), "slot handed out while live"
        assert min(new, default=self.page_size) >= self.page_size, "trash page handed out"

    def check_against_naive(
        self, out: np.ndarray | None, expected: tuple[np.ndarray, int] | None, estimate: int
    ) -> bool:
        """Compare an extend or decode allocation with the naive reference's ``expected``
        (``(slots, pages used)``, or None when too few pages are free) and take the pages from
        the model (its merge estimate ``estimate``). A refused call must change nothing. Returns
        whether the allocation succeeded."""
        if expected is None:
            assert out is None
            assert self.state() == (self.free, self.release, self.a.available_size())
            return False
        assert out is not None
        ref, used = expected
        assert self.model_take(used, estimate) is not None
        assert out.tolist() == ref.tolist()
        self.record_new(out)
        return True

    def state(self) -> tuple:
        return (self.a.free_pages.tolist(), self.a.release_pages.tolist(), self.a.available_size())

    def new_req(self, slots: list[int]) -> None:
        self.reqs[self.next_id] = slots
        self.next_id += 1

    # ------------------------------------------------------------------ rules

    @rule(n_pages=st.integers(0, 4))
    def alloc(self, n_pages: int) -> None:
        ps = self.page_size
        out = self.a.alloc(n_pages * ps)
        taken = self.model_take(n_pages)
        if taken is None:
            assert out is None
            return
        assert out is not None
        assert out.tolist() == [p * ps + o for p in taken for o in range(ps)]
        self.record_new(out)
        if n_pages:
            self.new_req(out.tolist())

    @rule(data=st.data())
    def alloc_extend(self, data: st.DataObject) -> None:
        ps = self.page_size
        ids = sorted(self.reqs)
        chosen = data.draw(st.lists(st.sampled_from(ids), max_size=3, unique=True)) if ids else []
        n_new = data.draw(st.integers(0, 2))
        batch: list[tuple[int | None, list[int]]] = [(rid, self.reqs[rid]) for rid in chosen]
        batch += [(None, []) for _ in range(n_new)]
        prefix = [len(s) for _, s in batch]
        room = [MAX_REQ_PAGES * ps - p for p in prefix]
        ext = [data.draw(st.integers(0, max(0, min(r, 3 * ps + 1)))) for r in room]
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        last = [s[-1] if s else -1 for _, s in batch]
        # SGLang 0.5.23's merge trigger: paged, its estimate; page 1, alloc(total)'s own test.
        estimate = sum(ext) // ps + len(batch) + 1 if self.paged else sum(ext)
        self.model_merge(estimate)
        expected = naive_alloc_extend(prefix, seq, last, self.free, ps)
        out = self.a.alloc_extend(np.array(prefix, np.int64), np.array(seq, np.int64), np.array(last, np.int64))
        if not self.check_against_naive(out, expected, estimate):
            return
        assert out is not None
        cursor = 0
        for (rid, slots), e in zip(batch, ext, strict=True):
            part = out[cursor : cursor + e].tolist()
            cursor += e
            if rid is None:
                if part:
                    self.new_req(part)
            else:
                self.reqs[rid] = slots + part

    def _pages_needed(self, prefix: list[int], seq: list[int]) -> int:
        ps = self.page_size
        return sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix, seq, strict=True))

    @rule(data=st.data())
    def alloc_decode(self, data: st.DataObject) -> None:
        ps = self.page_size
        ids = [rid for rid, s in sorted(self.reqs.items()) if len(s) < MAX_REQ_PAGES * ps]
        chosen = data.draw(st.lists(st.sampled_from(ids), max_size=4, unique=True)) if ids else []
        fresh = data.draw(st.booleans())
        batch: list[tuple[int | None, list[int]]] = [(rid, self.reqs[rid]) for rid in chosen]
        batch += [(None, [])] if fresh else []
        seq = [len(s) + 1 for _, s in batch]
        last = [s[-1] if s else -1 for _, s in batch]
        self.model_merge(len(batch))  # SGLang 0.5.23: merge when the batch exceeds the free pages
        expected = naive_alloc_decode(seq, last, self.free, ps)
        out = self.a.alloc_decode(seq, last)
        if not self.check_against_naive(out, expected, len(batch)):
            return
        assert out is not None
        for (rid, slots), s in zip(batch, out.tolist(), strict=True):
            if rid is None:
                self.new_req([s])
            else:
                self.reqs[rid] = slots + [s]

    def draw_tail(self, data: st.DataObject) -> tuple[int, int, np.ndarray]:
        """A live request and a tail of it from a page boundary: (request id, slots kept, the
        tail's slots in row order)."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs[rid]
        keep = data.draw(st.integers(0, -(-len(slots) // self.page_size))) * self.page_size
        return rid, keep, np.array(slots[keep:], np.int64)

    def model_free_tail(self, rid: int, keep: int, gone: np.ndarray, pages: list[int], *, segment: bool) -> None:
        """The model's side of freeing ``gone`` (request ``rid``'s slots from ``keep`` on), whose
        ``pages`` return in that order: now, or at the group's end (a paged allocator's segments
        after its plain frees)."""
        if keep:
            self.reqs[rid] = self.reqs[rid][:keep]
        else:
            del self.reqs[rid]
        if gone.size:
            self.stale.append(gone)
        if not pages:
            return
        if self.group is not None:
            (self.group_segments if segment and self.paged else self.group).append(pages)
            self.pending |= set(gone.tolist())
        else:
            self.model_give(pages)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        """Free a whole request, or its tail from a page boundary (speculative rollback)."""
        rid, keep, gone = self.draw_tail(data)
        if data.draw(st.booleans()):
            gone = gone[::-1].copy()  # any order within the call
        self.a.free(gone)
        self.model_free_tail(rid, keep, gone, self.pages_of(gone), segment=False)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_segment(self, data: st.DataObject) -> None:
        """Free a request's tail from a page boundary as a row segment: its pages in row order."""
        rid, keep, gone = self.draw_tail(data)
        self.a.free_segment(gone, start_pos=keep)
        pages = list(dict.fromkeys(int(s) // self.page_size for s in gone))  # first appearance: row order
        self.model_free_tail(rid, keep, gone, pages, segment=True)

    @rule(kind=st.sampled_from(["trash", "negative", "beyond", "stale", "duplicate"]), data=st.data())
    def bad_free(self, kind: str, data: st.DataObject) -> None:
        ps = self.page_size
        before = self.state()
        if kind == "trash":
            bad, err = [data.draw(st.integers(0, ps - 1))], InvalidSlotError
        elif kind == "negative":
            bad, err = [-1], InvalidSlotError
        elif kind == "beyond":
            bad, err = [(NUM_PAGES + 1) * ps], InvalidSlotError
        elif kind == "stale":
            live = self.live_slots()
            # Only arrays some of whose pages are free now (else the free would be legal).
            live_pages = {s // ps for s in live}
            cands = [g for g in self.stale if any(int(s) // ps not in live_pages for s in g)]
            if not cands:
                return
            bad, err = data.draw(st.sampled_from(cands)).tolist(), DoubleFreeError
        else:
            if self.paged or not self.reqs:
                return
            slots = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
            bad, err = slots + slots[:1], DoubleFreeError
        live_before = {k: list(v) for k, v in self.reqs.items()}
        with pytest.raises(err):
            self.a.free(np.array(bad, np.int64))
        assert self.state() == before
        assert self.reqs == live_before

    @precondition(lambda self: self.group is None)
    @rule()
    def group_begin(self) -> None:
        self.a.free_group_begin()
        self.group = []

    @precondition(lambda self: self.group is not None)
    @rule()
    def group_end(self) -> None:
        self.a.free_group_end()
        group, self.group = self.group, None
        assert group is not None
        pages = [p for g in group for p in g]
        if self.paged:
            pages = sorted(pages)
        if pages:
            self.model_give(pages)
        segments = [p for g in self.group_segments for p in g]
        self.group_segments = []
        if segments:
            self.model_give(segments)  # after the plain frees: in front of them
        self.pending = set()

    @precondition(lambda self: self.group is None and len(self.backups) < 3)
    @rule()
    def backup(self) -> None:
        model = (list(self.free), list(self.release), {k: list(v) for k, v in self.reqs.items()})
        self.backups.append((self.a.backup_state(), model))

    @precondition(lambda self: self.group is None and self.backups)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        state, (free, release, reqs) = data.draw(st.sampled_from(self.backups))
        self.a.restore_state(state)
        self.free, self.release = list(free), list(release)
        self.reqs = {k: list(v) for k, v in reqs.items()}

    @rule()
    def merge(self) -> None:
        self.a.merge_and_sort_free()
        if self.release:
            self.free = sorted(self.free + self.release)
            self.release = []

    # ------------------------------------------------------------------ invariants

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "a"):
            return
        ps = self.page_size
        self.a.check_invariants()
        assert self.a.free_pages.tolist() == self.free
        assert self.a.release_pages.tolist() == self.release
        assert self.a.available_size() == (len(self.free) + len(self.release)) * ps
        assert self.a.available_size() + self.a.used_size() == self.a.size
        live_pages = {s // ps for s in self.live_slots()}
        assert self.a.used_size() == len(live_pages) * ps
        for slots in self.reqs.values():
            for pos, s in enumerate(slots):
                assert s % ps == pos % ps, "slot offset must follow the token position"


SETTINGS = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class TokenMachine(AllocatorMachine):
    page_size = 1
    paged = False


class Paged4Machine(AllocatorMachine):
    page_size = 4
    paged = True


class Paged16Machine(AllocatorMachine):
    page_size = 16
    paged = True


TestTokenAllocatorStateful = TokenMachine.TestCase
TestTokenAllocatorStateful.settings = SETTINGS
TestPaged4AllocatorStateful = Paged4Machine.TestCase
TestPaged4AllocatorStateful.settings = SETTINGS
TestPaged16AllocatorStateful = Paged16Machine.TestCase
TestPaged16AllocatorStateful.settings = SETTINGS
