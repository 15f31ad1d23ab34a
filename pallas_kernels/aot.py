"""Ahead-of-time TPU compilation of the pool kernels at real shapes, without a TPU.

Needs libtpu (``pip install "jax[tpu]"``) but no TPU device: the compile targets a deviceless
topology (``jax.experimental.topologies``). Used by the TPU compile tests and the kernel
benchmark. With libtpu installed every JAX process takes libtpu's lockfile, so run this in a
process (and an environment) of its own.

The shapes are one Llama-3-8B attention layer (8 KV heads x head_dim 128, bf16: 4 KiB per token
for K and V) in a 1 GiB per-layer pool, and a hybrid model's recurrent state. Arguments are
``ShapeDtypeStruct`` on one device of the topology: a Mosaic kernel cannot be partitioned
automatically across devices (it must sit inside ``shard_map`` for that), so a replicated
multi-device sharding would not compile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

#: HBM bandwidth per chip in bytes/s (Google Cloud TPU documentation).
HBM_BYTES_PER_S = {"v5e": 819e9, "v6e": 1638e9, "v5p": 2765e9, "v4": 1200e9}
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1", "v4": "v4:2x2x1"}

KV_HEADS, HEAD_DIM = 8, 128
COMBINED = 2 * KV_HEADS
DTYPE = jnp.dtype(jnp.bfloat16)
TOKEN_BYTES = COMBINED * HEAD_DIM * DTYPE.itemsize  # one token's K and V in one layer
LAYER_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call at real shapes.

    ``args(sharding)`` builds the arguments; ``donate`` are the donated argument indices;
    ``aliased_bytes`` is what must come back aliased (the pools); ``bytes_moved`` is the HBM
    traffic the call needs at minimum (reads + writes), for the roofline.
    """

    name: str
    kernel: Callable[..., Any]
    reference: Callable[..., Any]
    args: Callable[[Any], tuple[Any, ...]]
    donate: tuple[int, ...]
    aliased_bytes: int
    bytes_moved: int


def pool_pages(page_size: int) -> int:
    """Allocatable pages of a 1 GiB per-layer pool at ``page_size``."""
    return LAYER_BYTES // (page_size * TOKEN_BYTES)


def _layers(sharding: Any, num_layers: int, page_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    shape = (pool_pages(page_size) + 1, page_size, COMBINED, HEAD_DIM)
    return tuple(jax.ShapeDtypeStruct(shape, DTYPE, sharding=sharding) for _ in range(num_layers))


def _ids(sharding: Any, n: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding)


def _layer_nbytes(page_size: int) -> int:
    return (pool_pages(page_size) + 1) * page_size * TOKEN_BYTES


# Hybrid-model recurrent state, 4 layers, 128 slots (+ slot 0): a conv state of
# [kernel - 1 = 3, conv_dim = 8192] bf16 stored tile-aligned as [3 * 8192 / 128, 128] (see
# state_slots), and an SSM state [heads, head_dim, state_dim] f32.
STATE_LAYERS, STATE_SLOTS = 4, 128
STATE_SHAPES = (((3 * 8192 // 128, 128), jnp.dtype(jnp.bfloat16)), ((32, 128, 128), jnp.dtype(jnp.float32)))


def _states(sharding: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(
        jax.ShapeDtypeStruct((STATE_LAYERS, STATE_SLOTS + 1, *shape), dtype, sharding=sharding)
        for shape, dtype in STATE_SHAPES
    )


def _state_bytes(per_slot: bool) -> int:
    slot = sum(math.prod(shape) * dtype.itemsize for shape, dtype in STATE_SHAPES) * STATE_LAYERS
    return slot if per_slot else slot * (STATE_SLOTS + 1)


def _write_args(sharding: Any, *, page_size: int, tokens: int) -> tuple[Any, ...]:
    """Arguments of a KV write of ``tokens`` tokens into one layer of ``page_size``-token pages."""
    return (
        _layers(sharding, 1, page_size)[0],
        jax.ShapeDtypeStruct((tokens, COMBINED, HEAD_DIM), DTYPE, sharding=sharding),
        _ids(sharding, tokens),
    )


def cases() -> list[Case]:
    """The compile cases: decode-step KV writes, copies, a 1 GiB offload gather, state ops."""
    out = []
    decode_tokens = 256
    for ps in (16, 64):
        out.append(
            Case(
                f"write_kv/page{ps}/decode{decode_tokens}",
                pk.write_kv,
                pk.write_kv_reference,
                functools.partial(_write_args, page_size=ps, tokens=decode_tokens),
                (0,),
                _layer_nbytes(ps),
                2 * decode_tokens * TOKEN_BYTES,
            )
        )
    prefill_tokens = 4096
    out.append(
        Case(
            f"write_kv/page16/prefill{prefill_tokens}",
            pk.write_kv,
            pk.write_kv_reference,
            lambda s: (
                _layers(s, 1, 16)[0],
                jax.ShapeDtypeStruct((prefill_tokens, COMBINED, HEAD_DIM), DTYPE, sharding=s),
                _ids(s, prefill_tokens),
            ),
            (0,),
            _layer_nbytes(16),
            2 * prefill_tokens * TOKEN_BYTES,
        )
    )
    layers, copy_slots_n, copy_pages_n = 2, 64, 16
    out.append(
        Case(
            f"copy_slots/page16/{layers}layers/{copy_slots_n}slots",
            pk.copy_slots,
            pk.copy_slots_reference,
            lambda s: (_layers(s, layers, 16), _ids(s, copy_slots_n), _ids(s, copy_slots_n)),
            (0,),
            layers * _layer_nbytes(16),
            2 * layers * copy_slots_n * TOKEN_BYTES,
        )
    )
    out.append(
        Case(
            f"copy_pages/page64/{layers}layers/{copy_pages_n}pages",
            pk.copy_pages,
            pk.copy_pages_reference,
            lambda s: (_layers(s, layers, 64), _ids(s, copy_pages_n), _ids(s, copy_pages_n)),
            (0,),
            layers * _layer_nbytes(64),
            2 * layers * copy_pages_n * 64 * TOKEN_BYTES,
        )
    )
    # Offload of 1 GiB: half of each of 2 layers.
    gather_pages = pool_pages(16) // 2
    out.append(
        Case(
            f"gather_pages/page16/{layers}layers/1GiB",
            pk.gather_pages,
            pk.gather_pages_reference,
            lambda s: (_layers(s, layers, 16), _ids(s, gather_pages)),
            (),
            0,
            2 * layers * gather_pages * 16 * TOKEN_BYTES,
        )
    )
    scatter_n = 64
    out.append(
        Case(
            f"scatter_pages/page16/{layers}layers/{scatter_n}pages",
            pk.scatter_pages,
            pk.scatter_pages_reference,
            lambda s: (
                _layers(s, layers, 16),
                jax.ShapeDtypeStruct((layers, scatter_n, 16, COMBINED, HEAD_DIM), DTYPE, sharding=s),
                _ids(s, scatter_n),
            ),
            (0,),
            layers * _layer_nbytes(16),
            2 * layers * scatter_n * 16 * TOKEN_BYTES,
        )
    )
    forks = 8
    out.append(
        Case(
            f"zero_slots/{STATE_LAYERS}layers/{forks}slots",
            pk.zero_slots,
            pk.zero_slots_reference,
            lambda s: (_states(s), _ids(s, forks)),
            (0,),
            _state_bytes(per_slot=False),
            forks * _state_bytes(per_slot=True),
        )
    )
    out.append(
        Case(
            f"copy_state_slots/{STATE_LAYERS}layers/{forks}slots",
            pk.copy_state_slots,
            pk.copy_state_slots_reference,
            lambda s: (_states(s), _ids(s, forks), _ids(s, forks)),
            (0,),
            _state_bytes(per_slot=False),
            2 * forks * _state_bytes(per_slot=True),
        )
    )
    return out


def topology_sharding(topology_name: str) -> jax.sharding.NamedSharding:
    """A one-device sharding on the first chip of a deviceless TPU topology."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_case(case: Case, sharding: Any, *, reference: bool = False) -> Any:
    """Compile ``case`` (the public wrapper, or the jnp reference) for the sharding's TPU."""
    fn = case.reference if reference else case.kernel
    return jax.jit(fn, donate_argnums=case.donate).trace(*case.args(sharding)).lower().compile()


def report(case: Case, generation: str, sharding: Any) -> dict[str, Any]:
    """Compile the kernel and the XLA reference of ``case``; figures on paper, nothing run."""
    row: dict[str, Any] = {"case": case.name, "generation": generation}
    try:
        compiled = compile_case(case, sharding)
        mem = compiled.memory_analysis()
        row.update(
            compiled=True,
            pallas_custom_call="tpu_custom_call" in compiled.as_text(),
            aliased_bytes=int(mem.alias_size_in_bytes),
            required_aliased_bytes=case.aliased_bytes,
            temp_bytes=int(mem.temp_size_in_bytes),
            output_bytes=int(mem.output_size_in_bytes),
        )
    except Exception as e:  # reported, not raised: the report lists every case
        row.update(compiled=False, error=f"{type(e).__name__}: {str(e)[:500]}")
    row["bytes_moved"] = case.bytes_moved
    row["roofline_us"] = round(case.bytes_moved / HBM_BYTES_PER_S[generation] * 1e6, 3)
    try:
        ref = compile_case(case, sharding, reference=True)
        cost = ref.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        ref_mem = ref.memory_analysis()
        row["xla_reference"] = {
            "optimal_us": round(float(cost.get("optimal_seconds", float("nan"))) * 1e6, 3),
            "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
            "aliased_bytes": int(ref_mem.alias_size_in_bytes),
            "temp_bytes": int(ref_mem.temp_size_in_bytes),
        }
    except Exception as e:
        row["xla_reference"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return row
