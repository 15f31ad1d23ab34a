"""Every pool kernel compiled for real TPU generations at real shapes, on a machine without a TPU.

Needs libtpu (the ``tpu`` extra): with it missing these tests FAIL, they do not skip. libtpu
takes a per-machine lockfile, so run this directory in a process of its own, after the main
suite (pytest's default run ignores it)::

    python -m pytest tests/tpu -q
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.timeout(300)

#: Temporaries allowed next to a 1-2 GiB pool: staging of the copied elements, scalar tables.
MAX_TEMP_BYTES = 8 << 20


def test_libtpu_is_installed() -> None:
    assert importlib.util.find_spec("libtpu") is not None, (
        "libtpu is not installed: install the project's 'tpu' extra (pip install '.[test,tpu]') "
        "in an environment of its own; these tests must run, not skip"
    )


def _cases():
    from pallas_kernels import aot

    return [pytest.param(c, id=c.name) for c in aot.cases()]


@pytest.fixture(scope="module", params=["v5e", "v6e", "v5p", "v4"])
def generation(request: pytest.FixtureRequest):
    from pallas_kernels import aot

    return request.param, aot.topology_sharding(aot.TOPOLOGIES[request.param])


@pytest.mark.parametrize("case", _cases())
def test_kernel_compiles_in_place_with_small_temporaries(generation, case) -> None:
    from pallas_kernels import aot

    name, sharding = generation
    compiled = aot.compile_case(case, sharding)
    assert "tpu_custom_call" in compiled.as_text(), f"{case.name} on {name}: the Pallas kernel was not selected"
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= case.aliased_bytes, (
        f"{case.name} on {name}: only {mem.alias_size_in_bytes} bytes aliased, the pools are {case.aliased_bytes}"
    )
    assert mem.temp_size_in_bytes <= MAX_TEMP_BYTES, (
        f"{case.name} on {name}: {mem.temp_size_in_bytes} bytes of temporaries (limit {MAX_TEMP_BYTES})"
    )


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_kernels_compile_per_device_under_shard_map_with_kv_heads_sharded(topology: str) -> None:
    """A Mosaic kernel cannot be partitioned automatically: a pool sharded over KV heads runs the
    wrappers inside ``jax.shard_map``, each device moving its own heads' rows in place."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pallas_kernels as pk
    from pallas_kernels import aot

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = Mesh(np.array(topo.devices), ("kv",))
    pool, rows, ids = P(None, None, "kv", None), P(None, "kv", None), P()
    shape = (aot.pool_pages(16) + 1, 16, aot.COMBINED, aot.HEAD_DIM)
    layer = jax.ShapeDtypeStruct(shape, aot.DTYPE, sharding=NamedSharding(mesh, pool))
    per_device = layer.size * layer.dtype.itemsize // mesh.size
    new_kv = jax.ShapeDtypeStruct((256, aot.COMBINED, aot.HEAD_DIM), aot.DTYPE, sharding=NamedSharding(mesh, rows))
    loc = jax.ShapeDtypeStruct((256,), jnp.int32, sharding=NamedSharding(mesh, ids))
    write = jax.shard_map(pk.write_kv, mesh=mesh, in_specs=(pool, rows, ids), out_specs=pool)
    copy = jax.shard_map(pk.copy_slots, mesh=mesh, in_specs=((pool, pool), ids, ids), out_specs=(pool, pool))
    calls = ((write, (layer, new_kv, loc), per_device), (copy, ((layer, layer), loc, loc), 2 * per_device))
    for fn, args, aliased in calls:
        compiled = jax.jit(fn, donate_argnums=0).trace(*args).lower().compile()
        assert "tpu_custom_call" in compiled.as_text()
        mem = compiled.memory_analysis()
        assert mem.alias_size_in_bytes >= aliased
        assert mem.temp_size_in_bytes <= MAX_TEMP_BYTES
