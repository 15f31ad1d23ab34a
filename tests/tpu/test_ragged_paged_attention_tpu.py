"""Ahead-of-time TPU compiles of the ragged paged attention kernel, from a host without a TPU.

Needs libtpu (the project's ``tpu`` extra, in an environment of its own): without it these tests
fail, they do not skip. Each case builds a deviceless topology (``v5e:2x2``, ``v6e:2x2``), traces
the public wrapper with ``jax.ShapeDtypeStruct`` arguments placed on it, and compiles: lowering for
TPU must select the Pallas kernel (a ``tpu_custom_call``) and Mosaic must accept it. Shapes are
Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16, page size 16, 2k context):

* one chip: decode (64 sequences x 1 token), prefill (4 x 512 tokens), a mixed batch, and decode
  with a sliding window and a logit soft cap;
* the 2x2 slice as a tensor-parallel group: KV heads sharded 4 ways under ``shard_map`` (2 KV
  heads and 8 query heads per chip), the way the pool is sharded.

Nothing here runs a kernel: it proves the kernel compiles for those chips, not its speed.
Run it in a process of its own (libtpu locks a file per process); with no TPU in use on the
host, ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` lets it run next to other JAX processes.
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

from pallas_kernels.ragged_paged_attention import ragged_paged_attention

pytestmark = pytest.mark.timeout(300)

TOPOLOGIES = ["v5e:2x2", "v6e:2x2"]

# Llama-3-8B attention.
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, CONTEXT = 32, 8, 128, 16, 2048

# name -> (max_seqs, total_q_tokens, options)
SHAPES = {
    "decode_64x1": (64, 64, {}),
    "prefill_4x512": (4, 2048, {}),
    "mixed_32seqs_512tokens": (32, 512, {}),
    "decode_64x1_window_softcap": (64, 64, dict(sliding_window=1024, soft_cap=50.0)),
}


@functools.cache
def _topology(name: str):
    return topologies.get_topology_desc(platform="tpu", topology_name=name)


def _args(mesh: Mesh, max_seqs: int, tokens: int, specs: tuple) -> tuple[jax.ShapeDtypeStruct, ...]:
    pages_per_seq = CONTEXT // PAGE_SIZE
    num_pages = max_seqs * pages_per_seq
    shapes = [
        ((tokens, Q_HEADS, HEAD_DIM), jnp.bfloat16),
        ((num_pages + 1, PAGE_SIZE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16),
        ((max_seqs,), jnp.int32),
        ((max_seqs, pages_per_seq), jnp.int32),
        ((max_seqs + 1,), jnp.int32),
        ((1,), jnp.int32),
    ]
    return tuple(
        jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
        for (shape, dtype), spec in zip(shapes, specs, strict=False)
    )


def _check(compiled: jax.stages.Compiled, args: tuple[jax.ShapeDtypeStruct, ...], num_devices: int = 1) -> None:
    """The compiled program calls the Mosaic kernel, returns the queries' shape, and never copies
    the pool: its temporaries stay far below one device's share of the KV pages."""
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    memory = compiled.memory_analysis()
    assert memory is not None, "the TPU compiler reports memory use for every program"
    q, kv_pages = args[0], args[1]
    q_bytes = q.size * q.dtype.itemsize // num_devices
    pool_bytes = kv_pages.size * kv_pages.dtype.itemsize // num_devices
    assert memory.output_size_in_bytes == q_bytes
    assert memory.temp_size_in_bytes < pool_bytes // 16, (memory.temp_size_in_bytes, pool_bytes)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_compiles_on_one_chip(topology: str, shape: str) -> None:
    max_seqs, tokens, options = SHAPES[shape]
    devices = np.asarray(_topology(topology).devices).reshape(-1)
    mesh = Mesh(devices[:1], ("x",))
    args = _args(mesh, max_seqs, tokens, (P(),) * 6)
    fn = functools.partial(ragged_paged_attention, sm_scale=HEAD_DIM**-0.5, **options)
    lowered = jax.jit(fn).trace(*args).lower()
    assert "tpu_custom_call" in lowered.as_text()  # the TPU lowering picked the kernel
    _check(lowered.compile(), args)


@pytest.mark.parametrize("shape", ["decode_64x1", "prefill_4x512"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_compiles_with_kv_heads_sharded(topology: str, shape: str) -> None:
    """Tensor parallel over the 4 chips: queries split by head, the pool by its combined head axis
    (K/V interleaved per head, so each chip holds whole heads), tables replicated."""
    max_seqs, tokens, options = SHAPES[shape]
    devices = np.asarray(_topology(topology).devices).reshape(-1)
    mesh = Mesh(devices, ("tp",))
    specs = (P(None, "tp", None), P(None, None, "tp", None), P(), P(), P(), P())
    args = _args(mesh, max_seqs, tokens, specs)
    attend = functools.partial(ragged_paged_attention, sm_scale=HEAD_DIM**-0.5, **options)
    fn = jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=P(None, "tp", None))
    _check(jax.jit(fn).trace(*args).lower().compile(), args, num_devices=len(devices))


@pytest.mark.parametrize("pool_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_fp8_pool_compiles_with_scales(topology: str, pool_dtype: str) -> None:
    """An fp8 pool with the layer's scales as traced f32 scalars and a bf16 query: the kernel
    reads fp8 pages (widened per block) and returns bf16."""
    max_seqs, tokens, _ = SHAPES["decode_64x1"]
    devices = np.asarray(_topology(topology).devices).reshape(-1)
    mesh = Mesh(devices[:1], ("x",))
    q, kv, *rest = _args(mesh, max_seqs, tokens, (P(),) * 6)
    kv = jax.ShapeDtypeStruct(kv.shape, jnp.dtype(pool_dtype), sharding=kv.sharding)
    scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))

    def fn(*a: jax.Array) -> jax.Array:
        return ragged_paged_attention(*a[:6], k_scale=a[6], v_scale=a[7], sm_scale=HEAD_DIM**-0.5)

    args = (q, kv, *rest, scale, scale)
    lowered = jax.jit(fn).trace(*args).lower()
    assert "tpu_custom_call" in lowered.as_text()
    compiled = lowered.compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    assert compiled.memory_analysis().output_size_in_bytes == q.size * q.dtype.itemsize


# Hybrid sliding-window models: Gemma-3-12B's attention (16 query heads, 8 KV heads, head_dim 256,
# window 1024; its sliding layers read the SWA pool's pages) and gpt-oss-20b's sliding layers
# (64 query heads, 8 KV heads, head_dim 64 padded to 128 in the pool, window 128, attention sinks
# as a traced f32 [64]).
HYBRID = {
    "gemma3_12b_decode_window": (16, 8, 256, 256, 1024, False),
    "gpt_oss_20b_decode_window_sinks": (64, 8, 64, 128, 128, True),
}


@pytest.mark.parametrize("model", list(HYBRID))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_hybrid_swa_models_compile(topology: str, model: str) -> None:
    q_heads, kv_heads, head_dim, dim_padded, window, sinks = HYBRID[model]
    max_seqs, pages_per_seq = 64, CONTEXT // PAGE_SIZE
    devices = np.asarray(_topology(topology).devices).reshape(-1)
    mesh = Mesh(devices[:1], ("x",))
    rep = NamedSharding(mesh, P())
    args = [
        jax.ShapeDtypeStruct((max_seqs, q_heads, head_dim), jnp.bfloat16, sharding=rep),
        jax.ShapeDtypeStruct(
            (max_seqs * pages_per_seq + 1, PAGE_SIZE, 2 * kv_heads, dim_padded), jnp.bfloat16, sharding=rep
        ),
        jax.ShapeDtypeStruct((max_seqs,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((max_seqs, pages_per_seq), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((max_seqs + 1,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep),
    ]
    if sinks:
        args.append(jax.ShapeDtypeStruct((q_heads,), jnp.float32, sharding=rep))

    def fn(*a: jax.Array) -> jax.Array:
        return ragged_paged_attention(
            *a[:6], sinks=a[6] if sinks else None, sm_scale=head_dim**-0.5, sliding_window=window
        )

    lowered = jax.jit(fn).trace(*args).lower()
    assert "tpu_custom_call" in lowered.as_text()
    compiled = lowered.compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    pool_bytes = args[1].size * args[1].dtype.itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes // 16  # the pool is never copied
