"""The MLA latent pool and the DSA indexer pool compiled for TPU without a TPU: their writes update
the layer in place (aliased, temporaries far below a layer) at DeepSeek-V3 shapes (kv_lora_rank
512 + qk_rope_head_dim 64 -> 640 lanes), one chip and replicated over a 2x2 slice, bf16 and fp8
e4m3 latents on v5e and v6e.

An fp8 latent layer is tiled ``(32, 128)`` in HBM while XLA's TPU scatter works on ``(8, 128)``
tiles: a scatter would relayout (copy) the layer, so fp8 rows are written with one update slice per
token on TPU (``kvjax.pools.mla.update_rows_in_order``), which these cases prove in place. The
uint8 indexer layer is written the same way (a scatter copies a 256 MiB one); its write is compiled
once, in its own test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.layout.mla import MLALayout
from kvjax.pools import DSAIndexerKeyPool, MLAKVPool

PAGE, RANK, ROPE, LAYERS, TOKENS, INDEX_DIM = 64, 512, 64, 2, 256, 128


def _layout(dtype: str) -> MLALayout:
    return MLALayout.for_platform(
        kv_lora_rank=RANK, qk_rope_head_dim=ROPE, page_size=PAGE, dtype=dtype, platform="tpu", index_head_dim=INDEX_DIM
    )


def _latent_pool(devices: np.ndarray, dtype: str) -> tuple[MLAKVPool, NamedSharding, int]:
    """An abstract latent pool (``ShapeDtypeStruct`` leaves) of ``LAYERS`` 256 MiB layers, replicated
    on ``devices``: the pool, its sharding, and the bytes of all its layers."""
    everywhere = NamedSharding(Mesh(devices, ("tp",)), P())
    layout = _layout(dtype)
    pages = (256 << 20) // (PAGE * layout.bytes_per_token_per_layer) - 1  # a 256 MiB layer
    shape = layout.shape(pages)
    layer = jax.ShapeDtypeStruct(shape, jnp.dtype(layout.storage_dtype), sharding=everywhere)
    scale = jax.ShapeDtypeStruct((LAYERS,), jnp.float32, sharding=everywhere)
    pool = MLAKVPool(
        kv=(layer,) * LAYERS, scale=scale, page_size=PAGE, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, dtype=dtype
    )
    return pool, everywhere, LAYERS * int(np.prod(shape)) * jnp.dtype(layout.storage_dtype).itemsize


def _memory(fn, *args):  # noqa: ANN001, ANN202
    return jax.jit(fn, donate_argnums=0).trace(*args).lower().compile().memory_analysis()


@pytest.mark.parametrize(
    "topology,dtype,replicated",
    [
        ("v5e:2x2", "bfloat16", False),
        ("v5e:2x2", "bfloat16", True),
        ("v6e:2x2", "bfloat16", False),
        ("v6e:2x2", "bfloat16", True),
        ("v5e:2x2", "fp8_e4m3", False),
        ("v6e:2x2", "fp8_e4m3", False),
    ],
    ids=["v5e-one_chip", "v5e-tp4", "v6e-one_chip", "v6e-tp4", "v5e-fp8-one_chip", "v6e-fp8-one_chip"],
)
def test_mla_writes_compile_in_place(topology: str, dtype: str, replicated: bool) -> None:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    devices = np.array(topo.devices) if replicated else np.array(topo.devices[:1])
    assert _layout(dtype).row_padded == 640
    pool, everywhere, pool_bytes = _latent_pool(devices, dtype)
    loc = jax.ShapeDtypeStruct((TOKENS,), jnp.int32, sharding=everywhere)
    nope = jax.ShapeDtypeStruct((TOKENS, RANK), jnp.bfloat16, sharding=everywhere)
    rope = jax.ShapeDtypeStruct((TOKENS, ROPE), jnp.bfloat16, sharding=everywhere)
    memory = _memory(lambda p, loc, a, b: p.set_mla_kv_buffer(1, loc, a, b), pool, loc, nope, rope)
    assert memory.alias_size_in_bytes >= pool_bytes, "the pool is updated in place"
    assert memory.temp_size_in_bytes < 4 << 20, memory.temp_size_in_bytes


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_move_kv_cache_compiles_in_place(dtype: str) -> None:
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x2")
    pool, everywhere, pool_bytes = _latent_pool(np.array(topo.devices[:1]), dtype)
    loc = jax.ShapeDtypeStruct((TOKENS,), jnp.int32, sharding=everywhere)
    memory = _memory(lambda p, tgt, src: p.move_kv_cache(tgt, src), pool, loc, loc)
    assert memory.alias_size_in_bytes >= pool_bytes
    assert memory.temp_size_in_bytes < 4 << 20, memory.temp_size_in_bytes


def test_indexer_write_compiles_in_place() -> None:
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x2")
    everywhere = NamedSharding(Mesh(np.array(topo.devices[:1]), ("tp",)), P())
    layout = _layout("bfloat16")
    pages = (256 << 20) // (PAGE * layout.indexer_bytes_per_token_per_layer) - 1  # a 256 MiB layer
    index_shape = layout.indexer_shape(pages)
    index_layer = jax.ShapeDtypeStruct(index_shape, jnp.uint8, sharding=everywhere)
    index_pool = DSAIndexerKeyPool(index_k=(index_layer,) * LAYERS, page_size=PAGE, index_head_dim=INDEX_DIM)
    loc = jax.ShapeDtypeStruct((TOKENS,), jnp.int32, sharding=everywhere)
    keys = jax.ShapeDtypeStruct((TOKENS, INDEX_DIM), jnp.bfloat16, sharding=everywhere)
    memory = _memory(lambda p, loc, k: p.set_index_k(0, loc, k), index_pool, loc, keys)
    assert memory.alias_size_in_bytes >= LAYERS * int(np.prod(index_shape))
    assert memory.temp_size_in_bytes < 4 << 20, memory.temp_size_in_bytes
