"""The recurrent-state pool compiled for TPU without a TPU: with the lane-dense conv storage
(TPU's default) a donated fork, zero and step write of one slot need no temporaries beyond a slot's
worth, at Qwen3-Next-80B's per-rank shapes at TP 8 (36 layers, conv window ``[1024, 3]`` bf16,
delta-rule state ``[4, 128, 128]`` f32, 256 slots). The logical ``[1024, 3]`` storage is the
known-bad layout: XLA copies the whole pool around the same ops (checked too, as the contrast)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.pools.recurrent import RecurrentStatePool

LAYERS, SLOTS, CONV, SSM = 36, 257, (1024, 3), (4, 128, 128)
OPS = {
    "fork": lambda p, s, d: p.fork(s, d),
    "zero": lambda p, s, d: p.zero_slots(s),
    "write": lambda p, s, d: p.set_states(5, s, [jnp.ones((1, *CONV), jnp.bfloat16)], jnp.ones((1, *SSM), jnp.float32)),
}


def _pool(mesh: Mesh, lane_dense: bool) -> RecurrentStatePool:
    rep = NamedSharding(mesh, P())
    stored = (-(-CONV[0] * CONV[1] // 128), 128) if lane_dense else CONV
    conv = jax.ShapeDtypeStruct((LAYERS, SLOTS, *stored), jnp.bfloat16, sharding=rep)
    ssm = jax.ShapeDtypeStruct((LAYERS, SLOTS, *SSM), jnp.float32, sharding=rep)
    return RecurrentStatePool(
        conv=(conv,),
        ssm=ssm,
        layer_ids=tuple(range(LAYERS)),
        conv_dtype="bfloat16",
        ssm_dtype="float32",
        conv_shapes=(CONV,) if lane_dense else None,
    )


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_lane_dense_state_updates_are_in_place(topology, op):
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))
    ids = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=NamedSharding(mesh, P()))
    pool = _pool(mesh, lane_dense=True)
    memory = jax.jit(OPS[op], donate_argnums=0).trace(pool, ids, ids).lower().compile().memory_analysis()
    assert memory.alias_size_in_bytes >= pool.ssm.size * 4, "the pool must be aliased (donated in place)"
    assert memory.temp_size_in_bytes < 1 << 20, f"{op}: {memory.temp_size_in_bytes} bytes of temporaries"


def test_the_logical_conv_layout_copies_the_pool():
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))
    ids = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=NamedSharding(mesh, P()))
    memory = jax.jit(OPS["fork"], donate_argnums=0).trace(_pool(mesh, False), ids, ids).lower().compile()
    assert memory.memory_analysis().temp_size_in_bytes > 1 << 30, "expected the known whole-pool copy"
