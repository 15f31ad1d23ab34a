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

    ``args(sharding)`` builds the arguments; ``donate`` are the donated argument indices (the
    pools: they must come back aliased, see ``aliased_bytes``); ``bytes_moved`` is the HBM traffic
    the call needs at minimum (reads + writes), for the roofline.
    """

    name: str
    kernel: Callable[..., Any]
    reference: Callable[..., Any]
    args: Callable[[Any], tuple[Any, ...]]
    bytes_moved: int
    donate: tuple[int, ...] = (0,)

    @property
    def aliased_bytes(self) -> int:
        """Bytes that must come back aliased: every donated argument (the pools), whole."""
        args = self.args(None)
        return sum(
            math.prod(leaf.shape) * leaf.dtype.itemsize for i in self.donate for leaf in jax.tree.leaves(args[i])
        )


def _case(
    kernel: Callable[..., Any],
    shape: str,
    args: Callable[[Any], tuple[Any, ...]],
    bytes_moved: int,
    donate: tuple[int, ...] = (0,),
) -> Case:
    """The case of the wrapper ``kernel`` of ``pallas_kernels`` and its ``<name>_reference``,
    named ``<name>/<shape>``."""
    name = kernel.__name__
    return Case(f"{name}/{shape}", kernel, getattr(pk, f"{name}_reference"), args, bytes_moved, donate)


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
    decode_tokens, prefill_tokens = 256, 4096
    layers, copy_slots_n, copy_pages_n, scatter_n = 2, 64, 16, 64
    gather_pages = pool_pages(16) // 2  # offload of 1 GiB: half of each of 2 layers
    forks = 8
    writes = ((16, "decode", decode_tokens), (64, "decode", decode_tokens), (16, "prefill", prefill_tokens))
    return [
        *(
            _case(
                pk.write_kv,
                f"page{ps}/{phase}{n}",
                functools.partial(_write_args, page_size=ps, tokens=n),
                2 * n * TOKEN_BYTES,
            )
            for ps, phase, n in writes
        ),
        _case(
            pk.copy_slots,
            f"page16/{layers}layers/{copy_slots_n}slots",
            lambda s: (_layers(s, layers, 16), _ids(s, copy_slots_n), _ids(s, copy_slots_n)),
            2 * layers * copy_slots_n * TOKEN_BYTES,
        ),
        _case(
            pk.copy_pages,
            f"page64/{layers}layers/{copy_pages_n}pages",
            lambda s: (_layers(s, layers, 64), _ids(s, copy_pages_n), _ids(s, copy_pages_n)),
            2 * layers * copy_pages_n * 64 * TOKEN_BYTES,
        ),
        _case(
            pk.gather_pages,
            f"page16/{layers}layers/1GiB",
            lambda s: (_layers(s, layers, 16), _ids(s, gather_pages)),
            2 * layers * gather_pages * 16 * TOKEN_BYTES,
            donate=(),
        ),
        _case(
            pk.scatter_pages,
            f"page16/{layers}layers/{scatter_n}pages",
            lambda s: (
                _layers(s, layers, 16),
                jax.ShapeDtypeStruct((layers, scatter_n, 16, COMBINED, HEAD_DIM), DTYPE, sharding=s),
                _ids(s, scatter_n),
            ),
            2 * layers * scatter_n * 16 * TOKEN_BYTES,
        ),
        _case(
            pk.zero_slots,
            f"{STATE_LAYERS}layers/{forks}slots",
            lambda s: (_states(s), _ids(s, forks)),
            forks * _state_bytes(per_slot=True),
        ),
        _case(
            pk.copy_state_slots,
            f"{STATE_LAYERS}layers/{forks}slots",
            lambda s: (_states(s), _ids(s, forks), _ids(s, forks)),
            2 * forks * _state_bytes(per_slot=True),
        ),
    ]


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
