"""Ahead-of-time TPU compiles of the ragged paged attention kernel over one rank of a token stripe,
returning its log-sum-exp (decode context parallelism), from a host without a TPU.

``ragged_paged_attention_with_lse(..., key_stride=4, key_offset=rank)`` inside ``shard_map`` over a
``"dcp"`` axis of the 4 chips of a ``v5e:2x2`` / ``v6e:2x2`` slice, ``rank`` the traced
``axis_index``: each chip holds 4 of every striped page's 16 rows (pages of 4 rows per chip),
Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16, 2k context). Lowering for
TPU must select the Pallas kernel (a ``tpu_custom_call``), Mosaic must accept it, the outputs are
the queries' shape and one f32 per query head and token, and the pool is never copied.

The MLA kernel the same way at DeepSeek-V3's shapes (16 query heads per chip, the latent row of
512 + 64 padded to 640), ``mla_ragged_paged_attention_with_lse``.

Run it in a process of its own (``.ci/tpu_compile.sh``: libtpu locks a file per process).
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

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_with_lse

pytestmark = pytest.mark.timeout(300)

TOPOLOGIES = ["v5e:2x2", "v6e:2x2"]
DCP = 4
Q_HEADS, KV_HEADS, HEAD_DIM, RANK_PAGE, CONTEXT = 32, 8, 128, 4, 2048
SHAPES = {"decode_64x1": (64, 64, {}), "mixed_32seqs_512tokens": (32, 512, dict(sliding_window=1024))}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_ranks_partial_attention_with_lse_compiles(topology: str, shape: str) -> None:
    max_seqs, tokens, options = SHAPES[shape]
    devices = np.asarray(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices).reshape(-1)
    mesh = Mesh(devices[:DCP], ("dcp",))
    pages_per_seq = CONTEXT // (RANK_PAGE * DCP)
    num_pages = max_seqs * pages_per_seq
    pool_spec = P(None, "dcp", None, None)  # each chip: its RANK_PAGE rows of every striped page
    shapes = [
        ((tokens, Q_HEADS, HEAD_DIM), jnp.bfloat16, P()),
        ((num_pages + 1, RANK_PAGE * DCP, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16, pool_spec),
        ((max_seqs,), jnp.int32, P()),
        ((max_seqs, pages_per_seq), jnp.int32, P()),
        ((max_seqs + 1,), jnp.int32, P()),
        ((1,), jnp.int32, P()),
    ]
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec)) for s, d, spec in shapes]
    attend = functools.partial(ragged_paged_attention_with_lse, sm_scale=HEAD_DIM**-0.5, key_stride=DCP, **options)

    def partial(*a: jax.Array) -> tuple[jax.Array, jax.Array]:
        out, lse = attend(*a, key_offset=jax.lax.axis_index("dcp"))
        return out[None], lse[None]

    fn = jax.shard_map(
        partial,
        mesh=mesh,
        in_specs=tuple(spec for *_, spec in shapes),
        out_specs=(P("dcp"), P("dcp")),
        check_vma=False,
    )
    lowered = jax.jit(fn).trace(*args).lower()
    assert "tpu_custom_call" in lowered.as_text()  # the TPU lowering picked the kernel
    compiled = lowered.compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    memory = compiled.memory_analysis()
    q_bytes = tokens * Q_HEADS * HEAD_DIM * 2
    lse_bytes = tokens * Q_HEADS * 4
    # Per chip: its partial output and its lse (the f32 [tokens, heads] tiled: at most 4x padding).
    assert q_bytes + lse_bytes <= memory.output_size_in_bytes <= q_bytes + 4 * lse_bytes, memory.output_size_in_bytes
    pool_bytes = (num_pages + 1) * RANK_PAGE * 2 * KV_HEADS * HEAD_DIM * 2  # one chip's rows
    assert memory.temp_size_in_bytes < pool_bytes // 16, (memory.temp_size_in_bytes, pool_bytes)


# DeepSeek-V3's absorbed MLA at tp 8 (16 query heads per chip): kv_lora_rank 512, rope 64, the
# latent row padded to 640 lanes.
MLA_HEADS, LATENT, ROPE, ROW = 16, 512, 64, 640


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_ranks_partial_mla_with_lse_compiles(topology: str) -> None:
    from pallas_kernels.mla_ragged_paged_attention import mla_ragged_paged_attention_with_lse

    max_seqs, tokens = 64, 64
    devices = np.asarray(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices).reshape(-1)
    mesh = Mesh(devices[:DCP], ("dcp",))
    pages_per_seq = CONTEXT // (RANK_PAGE * DCP)
    num_pages = max_seqs * pages_per_seq
    shapes = [
        ((tokens, MLA_HEADS, LATENT), jnp.bfloat16, P()),
        ((tokens, MLA_HEADS, ROPE), jnp.bfloat16, P()),
        ((num_pages + 1, RANK_PAGE * DCP, ROW), jnp.bfloat16, P(None, "dcp", None)),
        ((max_seqs,), jnp.int32, P()),
        ((max_seqs, pages_per_seq), jnp.int32, P()),
        ((max_seqs + 1,), jnp.int32, P()),
        ((1,), jnp.int32, P()),
    ]
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec)) for s, d, spec in shapes]

    def partial(*a: jax.Array) -> tuple[jax.Array, jax.Array]:
        rank = jax.lax.axis_index("dcp")
        out, lse = mla_ragged_paged_attention_with_lse(*a, sm_scale=0.1, key_stride=DCP, key_offset=rank)
        return out[None], lse[None]

    specs = tuple(spec for *_, spec in shapes)
    fn = jax.shard_map(partial, mesh=mesh, in_specs=specs, out_specs=(P("dcp"), P("dcp")), check_vma=False)
    lowered = jax.jit(fn).trace(*args).lower()
    assert "tpu_custom_call" in lowered.as_text()
    compiled = lowered.compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    pool_bytes = (num_pages + 1) * RANK_PAGE * ROW * 2  # one chip's rows
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes // 16
