"""Where a match or an insert stops inside an edge: the first differing token, found by the
guess-and-confirm search of ``RadixTree._common``, must be exact even when the guess is wrong
(tokens that agree again after the first difference, a small vocabulary), with bigram keys too;
and the split it leads to keeps both parts' keys intact."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.radix import RadixCache


def _aligned(n: int, ps: int) -> int:
    return max(n, 0) // ps * ps


def _first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _expected(edge: list[int], query: list[int], ps: int, eagle: bool) -> int:
    ex = 1 if eagle else 0
    first = _first_difference(edge, query)
    shared = first - ex
    return _aligned(min(shared, _aligned(len(edge) - ex, ps), _aligned(len(query) - ex, ps)), ps)


tokens = st.lists(st.integers(0, 2), min_size=2, max_size=70)


@settings(max_examples=200, deadline=None)
@given(
    edge=tokens,
    query=tokens,
    shared=st.integers(0, 60),
    ps=st.sampled_from([1, 4, 16]),
    eagle=st.booleans(),
    donate=st.booleans(),
)
def test_match_and_insert_stop_at_the_first_difference(edge, query, shared, ps, eagle, donate):
    # Give the two lists a common start of random length; a 3-token vocabulary makes the tokens
    # after the first difference agree often, so the probe search guesses wrong at times (pages
    # are probed on their last token).
    query = edge[:shared] + query
    tree = RadixCache(page_size=ps, is_eagle=eagle)
    tree.insert(list(edge), donate_key=donate)
    want = _expected(edge, query, ps, eagle)
    assert tree.match_prefix(list(query)).prefix_len == want
    tree.sanity_check()
    assert tree.insert(list(query), donate_key=donate) == want
    tree.sanity_check()
    # Both keys are still found whole after the splits.
    for key in (edge, query):
        assert tree.match_prefix(list(key)).prefix_len == _aligned(len(key) - (1 if eagle else 0), ps)


def test_split_leaves_the_callers_and_the_other_nodes_lists_alone():
    prompt = list(range(100, 132))
    tree = RadixCache(page_size=4)
    tree.insert(prompt)
    query = prompt[:16] + [7] * 8
    snapshot = list(query)
    m = tree.match_prefix(query)
    assert m.prefix_len == 16
    assert query == snapshot
    upper = m.last_node
    (lower,) = upper.children.values()
    assert upper.token_ids() == prompt[:16]
    assert lower.token_ids() == prompt[16:]
    tree.sanity_check()


def test_a_wrong_page_aligned_guess_restores_the_edge():
    # The probes agree on tokens 4..7, so the search guesses a split at 8 (a page boundary) and
    # cuts the edge's list there before confirming; token 3 differs, so the cut must be undone.
    edge = [5, 5, 5, 5, 1, 2, 3, 4] + [9] * 8
    query = [5, 5, 5, 6, 1, 2, 3, 4] + [8] * 8
    tree = RadixCache(page_size=4)
    tree.insert(edge)
    assert tree.match_prefix(list(query)).prefix_len == 0
    (leaf,) = tree.root_node.children.values()
    assert leaf.token_ids() == edge
    tree.sanity_check()
    assert tree.insert(list(query)) == 0
    assert tree.match_prefix(list(edge)).prefix_len == 16
    tree.sanity_check()
