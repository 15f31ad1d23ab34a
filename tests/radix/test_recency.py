"""`RecencyList`: the SWA component's recency order (oldest first), against a plain list model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.radix.recency import RecencyList


def test_insert_before_move_remove_keep_the_order():
    r = RecencyList()
    for x in "abc":
        r.append(x)
    r.insert_before("b", "s")  # a split: the new upper half just older than its suffix
    r.insert_before("a", "t")  # before the oldest: becomes the oldest
    assert list(r) == ["t", "a", "s", "b", "c"]
    r.move_to_end("a")
    r.move_to_end("a")  # already the newest: nothing moves
    r.move_to_end("t")
    assert list(r) == ["s", "b", "c", "a", "t"]
    r.remove("t")
    r.remove("s")
    assert list(r) == ["b", "c", "a"] and len(r) == 3 and "s" not in r and "b" in r
    with pytest.raises(KeyError):
        r.append("b")
    with pytest.raises(KeyError):
        r.insert_before("zz", "q")
    with pytest.raises(KeyError):
        r.move_to_end("zz")
    assert list(r) == ["b", "c", "a"]
    r.clear()
    assert list(r) == [] and len(r) == 0
    r.append("x")
    assert list(r) == ["x"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["append", "before", "move", "remove"]), st.integers(0, 9), st.integers(0, 9)))
)
def test_matches_a_list_model(ops):
    r = RecencyList()
    model: list[int] = []
    for op, x, y in ops:
        if op == "append" and x not in model:
            r.append(x)
            model.append(x)
        elif op == "before" and y in model and x not in model:
            r.insert_before(y, x)
            model.insert(model.index(y), x)
        elif op == "move" and x in model:
            r.move_to_end(x)
            model.remove(x)
            model.append(x)
        elif op == "remove" and x in model:
            r.remove(x)
            model.remove(x)
        assert list(r) == model and len(r) == len(model)
