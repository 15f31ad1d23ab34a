"""The pool methods themselves compiled for TPU without a TPU: the Pallas kernels are what runs,
in place, on one chip and with the pool sharded over KV heads (``shard_map`` inside the pool)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.pools import MHAKVPool

PAGE, KV_HEADS, HEAD_DIM, LAYERS, TOKENS = 16, 8, 128, 2, 256
PAGES = (1 << 30) // (PAGE * 2 * KV_HEADS * HEAD_DIM * 2) - 1  # a 1 GiB bf16 layer, trash page included


def pool_struct(mesh: Mesh, sharded: bool) -> MHAKVPool:
    spec = P(None, None, "tp", None) if sharded else P()
    layer = jax.ShapeDtypeStruct(
        (PAGES + 1, PAGE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16, sharding=NamedSharding(mesh, spec)
    )
    scale = jax.ShapeDtypeStruct((LAYERS,), jnp.float32, sharding=NamedSharding(mesh, P()))
    return MHAKVPool(
        kv=(layer,) * LAYERS,
        k_scale=scale,
        v_scale=scale,
        page_size=PAGE,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype="bfloat16",
        mesh=mesh if sharded else None,
        kv_head_axis="tp" if sharded else None,
    )


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one_chip", "tp4"])
def test_pool_methods_compile_to_pallas_in_place(topology: str, sharded: bool) -> None:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    devices = np.array(topo.devices) if sharded else np.array(topo.devices[:1])
    mesh = Mesh(devices, ("tp",))
    pool = pool_struct(mesh, sharded)
    replicated = NamedSharding(mesh, P())
    loc = jax.ShapeDtypeStruct((TOKENS,), jnp.int32, sharding=replicated)
    heads = P(None, "tp", None) if sharded else P()
    k = jax.ShapeDtypeStruct((TOKENS, KV_HEADS, HEAD_DIM), jnp.bfloat16, sharding=NamedSharding(mesh, heads))
    layer_bytes = (PAGES + 1) * PAGE * 2 * KV_HEADS * HEAD_DIM * 2 // devices.size

    write = jax.jit(lambda pool, loc, k: pool.set_kv_buffer(0, loc, k, k), donate_argnums=0)
    move = jax.jit(lambda pool, src, dst: pool.move_kv_cache(dst, src), donate_argnums=0)
    for fn, args, aliased in ((write, (pool, loc, k), layer_bytes), (move, (pool, loc, loc), LAYERS * layer_bytes)):
        compiled = fn.trace(*args).lower().compile()
        assert "tpu_custom_call" in compiled.as_text(), "the Pallas kernel, not the jnp reference"
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes >= aliased, "the pool is updated in place"
        assert memory.temp_size_in_bytes < 64 << 20


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_swa_pool_sliding_write_compiles_to_pallas_in_place(topology: str) -> None:
    """A sliding layer's write through the full->SWA mapping (a traced int32 mapping over a 1 GiB
    full pool's slots): the Pallas write, in place in the SWA pool."""
    from kvjax.pools import SWAKVPool

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = Mesh(np.array(topo.devices[:1]), ("tp",))
    replicated = NamedSharding(mesh, P())
    pool = SWAKVPool(
        full=pool_struct(mesh, False), swa=pool_struct(mesh, False), full_layer_ids=(1, 3), swa_layer_ids=(0, 2)
    )
    loc = jax.ShapeDtypeStruct((TOKENS,), jnp.int32, sharding=replicated)
    mapping = jax.ShapeDtypeStruct(((PAGES + 1) * PAGE + 1,), jnp.int32, sharding=replicated)
    k = jax.ShapeDtypeStruct((TOKENS, KV_HEADS, HEAD_DIM), jnp.bfloat16, sharding=replicated)
    write = jax.jit(lambda pool, loc, k, m: pool.set_kv_buffer(2, loc, k, k, full_to_swa=m), donate_argnums=0)
    compiled = write.trace(pool, loc, k, mapping).lower().compile()
    assert "tpu_custom_call" in compiled.as_text()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= (PAGES + 1) * PAGE * 2 * KV_HEADS * HEAD_DIM * 2, "in place"
    assert memory.temp_size_in_bytes < 64 << 20
