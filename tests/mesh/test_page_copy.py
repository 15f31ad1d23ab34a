"""The ``cpu_tensor`` page copy over a mesh (``kvjax.transfers.page_copy``): every device gathers
its own block of the copied pages, the copy keeps each distinct block once, and the load writes each
device's block back into the donated layers, exactly, for heads split over TP, rows striped over
DCP ranks (MLA's rank-3 pages) and a replicated pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.transfers.page_copy import copy_pages, load_pages

PAGES, PAGE_SIZE = 12, 2


@pytest.mark.parametrize(
    ("shape", "spec", "blocks"),
    [
        ((PAGES, PAGE_SIZE, 4, 8), P(None, None, "tp", None), 2),  # KV heads split over TP
        ((PAGES, PAGE_SIZE, 8), P(None, "tp", None), 2),  # MLA rows striped over DCP ranks
        ((PAGES, PAGE_SIZE, 4, 8), P(), 1),  # replicated: kept once
    ],
)
def test_copy_keeps_each_block_once_and_loads_each_device_its_own_in_place(shape, spec, blocks):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    sharding = NamedSharding(mesh, spec)
    values = [np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1000 * layer for layer in range(2)]
    layers = tuple(jax.device_put(jnp.asarray(v), sharding) for v in values)
    copy = copy_pages(layers, np.array([3, 4, 7]))
    assert copy.num_pages == 3 and len(copy.blocks) == blocks
    tail = copy.tail(PAGE_SIZE)  # from the second page on: pages 4 and 7
    new = load_pages(layers, tail, np.array([9, 10]))
    assert all(x.is_deleted() for x in layers), "the load writes the layers in place (donated)"
    assert all(isinstance(x.sharding, NamedSharding) and x.sharding.spec == sharding.spec for x in new)
    for v, x in zip(values, new, strict=True):
        got = np.asarray(x)
        np.testing.assert_array_equal(got[[9, 10]], v[[4, 7]])
        np.testing.assert_array_equal(got[:9], v[:9])
        np.testing.assert_array_equal(got[11:], v[11:])
    with pytest.raises(ValueError, match="3 pages loaded into 2"):
        load_pages(new, copy, np.array([9, 10]))
