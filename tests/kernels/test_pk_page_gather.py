"""Page gather/scatter kernels vs their reference; host round trip (pinned_host and fallback); OOB."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import page_gather
from pallas_kernels.testing import (
    PAGE_SIZES,
    TPU,
    assert_no_race,
    assert_same,
    interpreter_params,
    jit_interpreted,
    random_pool,
)
from tests.kernels.donation import run_donated

pytestmark = pytest.mark.timeout(60)
INTERPRETERS = interpreter_params()


def _layers(page_size: int, num_layers: int = 2, num_pages: int = 6, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    return tuple(random_pool(rng, num_pages, page_size, 2, 8) for _ in range(num_layers))


# A sequence's pages allocated in order (one run), a stray page, a repeat, one out of range.
GATHER = np.array([2, 3, 4, 1, 6, 3, 99], np.int32)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_gather_matches_reference(interpret, page_size: int) -> None:
    layers = _layers(page_size)
    want = page_gather.gather_pages_reference(layers, jnp.asarray(GATHER))
    got = jit_interpreted(page_gather.gather_pages, interpret=interpret)(layers, GATHER)
    assert got.shape == (2, GATHER.size, page_size, 2, 8)
    assert_same(got, want)
    np.testing.assert_array_equal(np.asarray(got[1, 0]), np.asarray(layers[1][2]))
    assert_no_race()


@pytest.mark.parametrize("interpret", [None, *INTERPRETERS])
def test_scatter_matches_reference_in_place(interpret) -> None:
    layers = tuple(jnp.array(x) for x in _layers(16))
    buffer = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 16, 2, 8)), jnp.float32)
    pages = np.array([3, 4, 5, 1, 0, 42], np.int32)  # a run, a single page, trash and out of range dropped
    want = page_gather.scatter_pages_reference(layers, buffer, jnp.asarray(pages))
    got = run_donated(page_gather.scatter_pages, layers, buffer, pages, interpret=interpret)
    assert_same(got, want)
    assert_no_race()


def test_offload_round_trip_through_pinned_host_memory() -> None:
    layers = _layers(16)
    pages = np.array([1, 2, 5], np.int32)
    host = page_gather.gather_pages_to_host(layers, pages)
    assert isinstance(host, jax.Array) and host.sharding.memory_kind == "pinned_host"
    restored = page_gather.scatter_pages_from_host(
        tuple(jnp.zeros_like(x) for x in layers), host, np.array([4, 5, 6], np.int32)
    )
    for before, after in zip(layers, restored, strict=False):
        np.testing.assert_array_equal(np.asarray(after[4:7]), np.asarray(before)[pages])


def test_offload_falls_back_to_numpy_without_pinned_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_gather, "has_memory_kind", lambda device, kind="pinned_host": False)
    layers = _layers(16)
    host = page_gather.gather_pages_to_host(layers, [1, 2])
    assert isinstance(host, np.ndarray) and host.shape == (2, 2, 16, 2, 8)
    restored = page_gather.scatter_pages_from_host(tuple(jnp.zeros_like(x) for x in layers), host, [3, 4])
    np.testing.assert_array_equal(np.asarray(restored[0][3:5]), np.asarray(layers[0][1:3]))


def test_out_of_bounds_read_is_caught_by_tpu_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bypass the wrapper's routing of bad page ids: the interpreter must refuse the read."""
    monkeypatch.setattr(page_gather, "_src_pages", lambda pages, num_pages: pages)
    layers = _layers(16, num_layers=1)
    with pytest.raises(Exception, match="(?i)out-of-bounds"):
        jit_interpreted(page_gather.gather_pages, interpret=TPU)(layers, np.array([9], np.int32)).block_until_ready()


def test_bad_arguments_are_named() -> None:
    layers = _layers(4, num_layers=2, num_pages=2)
    with pytest.raises(ValueError, match=r"buffer has shape \[2, 3, 4, 2, 8\]; expected \[2, 2, 4, 2, 8\]"):
        page_gather.scatter_pages(layers, jnp.zeros((2, 3, 4, 2, 8)), jnp.array([1, 2]))
    with pytest.raises(TypeError, match="buffer has dtype int32; expected float32"):
        page_gather.scatter_pages(layers, jnp.zeros((2, 2, 4, 2, 8), jnp.int32), jnp.array([1, 2]))
    with pytest.raises(TypeError, match="pages has dtype float32"):
        page_gather.gather_pages(layers, jnp.array([1.0]))
    assert page_gather.gather_pages(layers, jnp.zeros((0,), jnp.int32)).shape == (2, 0, 4, 2, 8)
