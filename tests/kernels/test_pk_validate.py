"""Host-side id checks: bad ids are rejected with errors naming them, never clamped."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.errors import InvalidSlotError
from pallas_kernels import validate


def test_out_of_range_ids_are_named() -> None:
    with pytest.raises(InvalidSlotError, match=r"loc: slot id\(s\) outside \[0, 64\): \[64, -1\]"):
        validate.check_kv_write([3, 64, -1], num_slots=64, page_size=16)
    many = np.arange(100, 120)
    with pytest.raises(InvalidSlotError, match=r"\.\.\. \(20 in all\)"):
        validate.check_ids_in_range("src", many, 0, 10)


def test_duplicate_live_slots_are_rejected_but_trash_padding_is_not() -> None:
    validate.check_kv_write([0, 0, 1, 20, 21], num_slots=64, page_size=16)  # padding on page 0
    with pytest.raises(InvalidSlotError, match=r"duplicate slot id\(s\) \[20\]"):
        validate.check_kv_write([20, 21, 20], num_slots=64, page_size=16)
    with pytest.raises(InvalidSlotError, match="outside"):
        validate.check_kv_write([3], num_slots=64, page_size=16, allow_trash=False)


def test_copy_and_fork_checks() -> None:
    validate.check_copy([1, 2], [3, 4], num_ids=5, first_live=1, kind="page")
    with pytest.raises(InvalidSlotError, match=r"dst: page id\(s\) outside \[1, 5\): \[0\]"):
        validate.check_copy([1], [0], num_ids=5, first_live=1, kind="page")
    with pytest.raises(InvalidSlotError, match="one dst per src"):
        validate.check_copy([1, 2], [3], num_ids=5, first_live=1)
    validate.check_fork([1, 2], [3, 4], num_slots=8)
    with pytest.raises(InvalidSlotError, match=r"state slot id\(s\) \[2\] are also in src"):
        validate.check_fork([1, 2], [2, 4], num_slots=8)
    with pytest.raises(InvalidSlotError, match="integer ids"):
        validate.check_ids_in_range("loc", [1.5], 0, 4)
