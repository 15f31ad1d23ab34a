"""Ahead-of-time TPU compiles of MLA ragged paged attention at DeepSeek-V3 shapes, without a TPU.

DeepSeek-V3 attention: 128 query heads, kv_lora_rank 512, qk_rope_head_dim 64 (latent row 576,
padded to 640 lanes), page size 64, 4k context, bf16 and fp8 latent pools. tp 1: all 128 heads on
one chip. tp 8: heads split 8 ways (16 per chip), the latent replicated, under ``shard_map`` on a
2x4 slice. Decode (64 sequences x 1 token) and a mixed batch (16 sequences, 512 tokens). Proves
the kernel compiles for v5e and v6e, not its speed (``benchmarks/mla_roofline.py`` has the paper
roofline).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.mla_ragged_paged_attention import mla_ragged_paged_attention

pytestmark = pytest.mark.timeout(600)

HEADS, RANK, ROPE, ROW, PAGE, CONTEXT = 128, 512, 64, 640, 64, 4096
SM_SCALE = (128 + 64) ** -0.5
SHAPES = {"decode_64x1": (64, 64), "mixed_16seqs_512tokens": (16, 512)}


@functools.cache
def _topology(name: str):
    return topologies.get_topology_desc(platform="tpu", topology_name=name)


def _args(mesh: Mesh, max_seqs: int, tokens: int, pool_dtype, head_spec: P) -> tuple:
    pages_per_seq = CONTEXT // PAGE
    rep = NamedSharding(mesh, P())
    heads = NamedSharding(mesh, head_spec)
    return (
        jax.ShapeDtypeStruct((tokens, HEADS, RANK), jnp.bfloat16, sharding=heads),
        jax.ShapeDtypeStruct((tokens, HEADS, ROPE), jnp.bfloat16, sharding=heads),
        jax.ShapeDtypeStruct((max_seqs * pages_per_seq + 1, PAGE, ROW), pool_dtype, sharding=rep),
        jax.ShapeDtypeStruct((max_seqs,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((max_seqs, pages_per_seq), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((max_seqs + 1,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
    )


def _attend(*a: jax.Array) -> jax.Array:
    return mla_ragged_paged_attention(*a[:7], kv_scale=a[7], sm_scale=SM_SCALE)


@pytest.mark.parametrize("pool_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_compiles_tp1(topology: str, shape: str, pool_dtype: str) -> None:
    mesh = Mesh(np.asarray(_topology(topology).devices).reshape(-1)[:1], ("tp",))
    args = _args(mesh, *SHAPES[shape], jnp.dtype(pool_dtype), P())
    lowered = jax.jit(_attend).trace(*args).lower()
    assert "tpu_custom_call" in lowered.as_text()
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    assert memory.output_size_in_bytes == args[0].size * 2
    # Temporaries are the padded query rows (bf16) and the f32 output rows, never a copy of the pool.
    query_rows = args[0].shape[0] * HEADS * (ROW * 2 + RANK * 4)
    assert memory.temp_size_in_bytes < query_rows + (16 << 20), (memory.temp_size_in_bytes, query_rows)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_compiles_tp8_heads_sharded(topology: str) -> None:
    devices = np.asarray(_topology(topology).devices).reshape(-1)
    assert devices.size == 8
    mesh = Mesh(devices, ("tp",))
    head_spec = P(None, "tp", None)
    args = _args(mesh, *SHAPES["decode_64x1"], jnp.dtype(jnp.bfloat16), head_spec)
    specs = (head_spec, head_spec) + (P(),) * 6
    fn = jax.shard_map(_attend, mesh=mesh, in_specs=specs, out_specs=head_spec)
    compiled = jax.jit(fn).trace(*args).lower().compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
