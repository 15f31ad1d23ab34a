"""The DCP stripe: SGLang's ``allocator/dcp.py`` layout of token slots over decode-context-parallel
ranks (token ``i`` of a request on rank ``i % dcp`` at local row ``i // dcp``), on slots a paged
allocator of striped pages hands out."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.alloc import PagedTokenToKVPoolAllocator
from kvjax.alloc.dcp import DCPStripe, make_dcp_allocator


@pytest.mark.parametrize(("page_size", "dcp"), [(1, 2), (2, 4), (4, 2), (3, 8)])
def test_a_requests_tokens_go_to_rank_i_mod_dcp_at_row_i_div_dcp(page_size, dcp):
    stripe = DCPStripe(page_size, dcp)
    alloc = make_dcp_allocator(16 * page_size, page_size, dcp)
    assert isinstance(alloc, PagedTokenToKVPoolAllocator)
    assert alloc.page_size == page_size * dcp and alloc.available_size() == 16 * page_size * dcp
    # Two requests, grown by an extend then decodes: the slots of positions 0 .. n - 1.
    lens = np.array([5 * page_size * dcp - 1, 2 * page_size * dcp + 3])
    first = alloc.alloc_extend(np.zeros(2, np.int64), lens, np.array([-1, -1]))
    assert first is not None
    slots = [first[: lens[0]], first[lens[0] :]]
    for _ in range(dcp + 1):
        last = np.array([s[-1] for s in slots])
        new = alloc.alloc_decode(np.array([len(s) + 1 for s in slots]), last)
        assert new is not None
        slots = [np.append(s, n) for s, n in zip(slots, new, strict=True)]
    local_slots = {r: [] for r in range(dcp)}
    for req in slots:
        pos = np.arange(len(req))
        assert (stripe.owner(req) == pos % dcp).all()
        local = stripe.local_slot(req)
        # Rank r's share of the request: local row (i % (page_size * dcp)) // dcp of the same page id.
        assert (local // page_size == req // stripe.alloc_page_size).all()
        assert (local % page_size == (pos % stripe.alloc_page_size) // dcp).all()
        for r in range(dcp):
            local_slots[r].extend(local[pos % dcp == r].tolist())
        held = [stripe.rank_tokens(len(req), r) for r in range(dcp)]
        assert sum(held) == len(req) and held == [int(np.count_nonzero(pos % dcp == r)) for r in range(dcp)]
    for r in range(dcp):  # no two tokens share a row of one rank; page 0 (trash) is never used
        assert len(set(local_slots[r])) == len(local_slots[r]) and min(local_slots[r]) >= page_size
    every = np.concatenate(slots)
    rows = stripe.global_row(every)
    assert len(set(rows.tolist())) == len(every)
    assert (rows // stripe.alloc_page_size == every // stripe.alloc_page_size).all(), "same page id on every rank"


def test_bad_stripes_are_refused():
    for bad in (dict(page_size=0, dcp=2), dict(page_size=2, dcp=0), dict(page_size=True, dcp=2)):
        with pytest.raises(ValueError, match="must be a positive integer"):
            DCPStripe(**bad)
    with pytest.raises(ValueError, match="size_per_rank=3 holds no page of 4 tokens per rank"):
        make_dcp_allocator(3, 4, 2)


@pytest.mark.parametrize(("page_size", "dcp"), [(1, 2), (2, 4), (3, 2)])
def test_a_striped_pages_rows_are_rank_major_each_rank_holding_its_local_rows(page_size, dcp):
    """``page_row``: slot offset ``o`` of a striped page is row ``(o % dcp) * page_size + o // dcp``,
    so rank ``r``'s rows are the contiguous run ``r * page_size ..`` (what the host tier copies per
    device) and the page's offsets fill every row once."""
    stripe = DCPStripe(page_size, dcp)
    offsets = np.arange(stripe.alloc_page_size)
    rows = stripe.page_row(offsets)
    assert sorted(rows.tolist()) == list(range(stripe.alloc_page_size))
    for rank in range(dcp):
        mine = offsets[stripe.owner(offsets) == rank]
        assert rows[mine].tolist() == list(range(rank * page_size, (rank + 1) * page_size))
        assert (stripe.local_slot(mine) == mine // dcp).all()
