"""Slot and page copy kernels vs their reference; snapshot semantics of chains; races; in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import page_copy
from pallas_kernels.page_copy import copy_pages, copy_pages_reference, copy_slots, copy_slots_reference
from pallas_kernels.testing import (
    TPU,
    Heads,
    assert_no_race,
    assert_same,
    interpreter_params,
    jit_interpreted,
    num_pages_for,
    race_found,
    random_pool,
    shape_params,
)
from tests.kernels.donation import run_donated

pytestmark = pytest.mark.timeout(60)
INTERPRETERS = interpreter_params()


def _layers(
    page_size: int, heads: Heads, num_pages: int | None = None, num_layers: int = 1, seed: int = 0
) -> tuple[jax.Array, ...]:
    """Tiny pools; one layer where the per-layer loop is not the point (it halves compile time)."""
    rng = np.random.default_rng(seed)
    num_pages = num_pages or num_pages_for(page_size)
    return tuple(random_pool(rng, num_pages, page_size, heads.combined, heads.padded) for _ in range(num_layers))


def _slot_pattern(page_size: int, num_pages: int, chained: bool) -> tuple[np.ndarray, np.ndarray]:
    """Copy-on-write of a partial page (a run), a single slot, dropped destinations; with
    ``chained`` also ``a -> b, b -> c`` and a swap, so the staged (snapshot) path runs."""
    ps = page_size
    last = num_pages * ps  # first slot of the last page
    run = max(1, ps // 2)
    src = list(range(ps, ps + run)) + [ps + run]
    dst = list(range(last, last + run)) + [-3]
    src, dst = src + [ps + 1 if ps > 1 else 2 * ps, 0], dst + [0, last + run]  # trash dst dropped
    if chained:
        a, b, c = ps * 2 - 1, ps * 2, ps * 2 + 1
        src += [a, b, c, ps * 2 + 2]
        dst += [b, c, ps * 2 + 2, a]
    return np.asarray(src, np.int32), np.asarray(dst, np.int32)


@pytest.mark.parametrize("shape", shape_params()[:3])  # the row shape is write_kv's concern
@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_copy_slots_matches_reference(interpret, shape: tuple[int, Heads]) -> None:
    page_size, heads = shape
    num_pages = max(4, num_pages_for(page_size))
    layers = _layers(page_size, heads, num_pages)
    src, dst = _slot_pattern(page_size, num_pages, chained=page_size != 16)
    want = copy_slots_reference(layers, jnp.asarray(src), jnp.asarray(dst))
    got = jit_interpreted(copy_slots, interpret=interpret)(layers, src, dst)
    assert_same(got, want)
    assert_no_race()


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_copy_pages_matches_reference(interpret, page_size: int) -> None:
    layers = _layers(page_size, Heads("gqa", 1, 8, 4), num_pages=6)
    if page_size == 16:  # disjoint: a run of three pages, a single page, a dropped one
        src, dst = np.array([1, 2, 3, 6, 2], np.int32), np.array([4, 5, 6, 1, 0], np.int32)
    else:  # chain and swap: staged
        src, dst = np.array([1, 2, 5, 6, 9], np.int32), np.array([2, 3, 6, 5, 4], np.int32)
    want = copy_pages_reference(layers, jnp.asarray(src), jnp.asarray(dst))
    got = jit_interpreted(copy_pages, interpret=interpret)(layers, src, dst)
    assert_same(got, want)
    assert_no_race()


@pytest.mark.parametrize("interpret", [None, *INTERPRETERS])
def test_chained_and_swapped_copies_read_everything_before_writing(interpret) -> None:
    """Snapshot semantics, spelled out: 1->2, 2->3 puts the old slot 2 into 3; 5<->6 swaps."""
    layers = _layers(1, Heads("gqa", 1, 8, 4), num_pages=8, num_layers=2)
    src, dst = np.array([1, 2, 5, 6], np.int32), np.array([2, 3, 6, 5], np.int32)
    got = jit_interpreted(copy_slots, interpret=interpret)(layers, src, dst)
    for before, after in zip(layers, got, strict=False):
        before, after = np.asarray(before), np.asarray(after)
        for s, d in [(1, 2), (2, 3), (5, 6), (6, 5)]:
            np.testing.assert_array_equal(after[d], before[s])
        for untouched in (0, 1, 4, 7, 8):
            np.testing.assert_array_equal(after[untouched], before[untouched])
    assert_no_race()


@pytest.mark.parametrize("interpret", [None, TPU])
def test_donated_layers_are_updated_in_place(interpret) -> None:
    layers = tuple(jnp.array(x) for x in _layers(16, Heads("gqa", 1, 8, 4), num_pages=4, num_layers=2))
    src, dst = np.array([1, 2], np.int32), np.array([3, 4], np.int32)
    want = copy_pages_reference(layers, jnp.asarray(src), jnp.asarray(dst))
    out = run_donated(copy_pages, layers, src, dst, interpret=interpret)
    assert_same(out, want)


def test_chain_without_staging_is_reported_as_a_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend no destination is a source: 1->2 and 2->3 then run concurrently, and the TPU
    interpreter must see slot 2 read and written by DMAs in flight together."""
    monkeypatch.setattr(page_copy, "_dst_overlaps_src", lambda src, dst: jnp.zeros((1,), jnp.int32))
    layers = _layers(1, Heads("gqa", 1, 8, 4), num_pages=8)
    src, dst = np.array([1, 2], np.int32), np.array([2, 3], np.int32)
    jit_interpreted(copy_slots, interpret=TPU)(layers, src, dst)[0].block_until_ready()
    assert race_found()


def test_bad_arguments_are_named() -> None:
    layers = (jnp.zeros((3, 4, 2, 8)), jnp.zeros((3, 4, 2, 8)))
    with pytest.raises(ValueError, match=r"dst has shape \[3\]; expected \[2\]"):
        copy_slots(layers, jnp.array([1, 2]), jnp.array([5, 6, 7]))
    with pytest.raises(ValueError, match=r"layers\[1\] is float32\[3, 4, 2, 4\]; expected float32\[3, 4, 2, 8\]"):
        copy_pages((layers[0], jnp.zeros((3, 4, 2, 4))), jnp.array([1]), jnp.array([2]))
    with pytest.raises(TypeError, match="layers must be a non-empty tuple"):
        copy_pages(layers[0], jnp.array([1]), jnp.array([2]))
    with pytest.raises(ValueError, match=r"src has shape \[1, 2\]"):
        copy_pages(layers, jnp.array([[1, 2]]), jnp.array([2]))
