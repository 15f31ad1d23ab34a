"""The state-slot allocator: FIFO, slot 0 reserved, validated frees."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.alloc.state_slots import StateSlotAllocator
from kvjax.errors import DoubleFreeError, InvalidSlotError


def test_fifo_from_one_and_slot_zero_reserved():
    a = StateSlotAllocator(4)
    assert a.alloc(2).tolist() == [1, 2]
    a.free([1])
    assert a.alloc(3).tolist() == [3, 4, 1]
    assert a.alloc(1) is None and a.available_size() == 0
    a.check_invariants()


@pytest.mark.parametrize(
    "bad,error,match",
    [
        ([2], DoubleFreeError, r"already free.*\[2\]"),
        ([1, 1], DoubleFreeError, "more than once"),
        ([0], InvalidSlotError, "padding slot"),
        ([5], InvalidSlotError, r"outside \[1, 4\]"),
    ],
)
def test_bad_frees_raise_and_change_nothing(bad, error, match):
    a = StateSlotAllocator(4)
    a.alloc(1)
    before = (a.available_size(), a.free_slots.tolist())
    with pytest.raises(error, match=match):
        a.free(np.array(bad))
    assert (a.available_size(), a.free_slots.tolist()) == before
    a.check_invariants()


def test_liveness():
    a = StateSlotAllocator(3)
    a.alloc(1)
    assert a.is_live([0, 1, 2, 9]).tolist() == [False, True, False, False]
    with pytest.raises(InvalidSlotError, match=r"\[2\].*free"):
        a.check_live([1, 2], "fork dst")
