"""The host tier's staged transfers compiled for TPU without a TPU: the backup's page gather
(output in ``pinned_host`` memory) and the load's scatter are the Pallas kernels, the scatter in
place (``kvjax.transfers.transfer``; the CPU backend takes the direct path instead)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.transfers.transfer import _gather_to, _scatter
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


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_per_shard_backup_gather_and_load_scatter_over_8_chips(topology: str) -> None:
    """A pool sharded over 8 chips' KV heads: each chip gathers and scatters its own heads with
    the Pallas kernels, the scatter in place on every chip, no collective, temporaries of the
    moved pages only (``_gather_per_shard`` / ``_scatter_per_shard``)."""
    from kvjax.transfers.transfer import _buffer_spec, _gather_per_shard, _scatter_per_shard

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = Mesh(np.array(topo.devices), ("tp",))
    spec = P(None, None, "tp", None)
    heads = NamedSharding(mesh, spec)
    layer = jax.ShapeDtypeStruct((PAGES + 1, PAGE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16, sharding=heads)
    layers = (layer,) * LAYERS
    specs = (spec,) * LAYERS
    pages = jax.ShapeDtypeStruct((MOVED,), jnp.int32, sharding=NamedSharding(mesh, P()))
    buffer = jax.ShapeDtypeStruct(
        (LAYERS, MOVED, PAGE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16, sharding=NamedSharding(mesh, _buffer_spec(spec))
    )
    gather = _gather_per_shard(mesh, specs, PINNED_HOST).trace(layers, pages).lower().compile()
    scatter = _scatter_per_shard(mesh, specs).trace(layers, buffer, pages).lower().compile()
    moved_bytes = LAYERS * MOVED * PAGE * 2 * HEAD_DIM * 2  # one chip's heads of the moved pages
    chip_layer_bytes = (PAGES + 1) * PAGE * 2 * HEAD_DIM * 2  # one chip's shard of a layer
    for name, compiled in (("gather", gather), ("scatter", scatter)):
        text = compiled.as_text()
        assert "tpu_custom_call" in text, f"the Pallas {name}, not the jnp reference"
        assert not any(op in text for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all"))
        assert compiled.memory_analysis().temp_size_in_bytes <= 2 * moved_bytes, f"{name}: O(pages) temporaries"
    assert scatter.memory_analysis().alias_size_in_bytes >= LAYERS * chip_layer_bytes, "each chip scatters in place"
