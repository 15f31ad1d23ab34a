"""The host tier's staged transfers compiled for TPU without a TPU: the backup's page gather
(output in ``pinned_host`` memory) and the load's scatter are the Pallas kernels, the scatter in
place (``kvjax.tiers.transfer``; the CPU backend takes the direct path instead)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.tiers.transfer import _gather_to, _scatter
from pallas_kernels.page_gather import PINNED_HOST

PAGE, KV_HEADS, HEAD_DIM, LAYERS, PAGES, MOVED = 16, 8, 128, 2, 4095, 64


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_staged_backup_gather_and_load_scatter_compile_to_pallas(topology: str) -> None:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = Mesh(np.array(topo.devices[:1]), ("tp",))
    on_device = NamedSharding(mesh, P())
    layer = jax.ShapeDtypeStruct((PAGES + 1, PAGE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16, sharding=on_device)
    layers = (layer,) * LAYERS
    pages = jax.ShapeDtypeStruct((MOVED,), jnp.int32, sharding=on_device)
    buffer = jax.ShapeDtypeStruct((LAYERS, MOVED, PAGE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16, sharding=on_device)

    gather = _gather_to(on_device.with_memory_kind(PINNED_HOST)).trace(layers, pages).lower().compile()
    assert "tpu_custom_call" in gather.as_text(), "the Pallas gather, not the jnp reference"
    scatter = _scatter.trace(layers, buffer, pages).lower().compile()
    assert "tpu_custom_call" in scatter.as_text(), "the Pallas scatter, not the jnp reference"
    layer_bytes = (PAGES + 1) * PAGE * 2 * KV_HEADS * HEAD_DIM * 2
    assert scatter.memory_analysis().alias_size_in_bytes >= LAYERS * layer_bytes, "the load scatters in place"
