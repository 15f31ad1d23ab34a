"""A tensor-parallel decoder layer's serving step compiled for 8-chip TPU slices without a TPU.

``kvjax.serve.sharded_layer_probe`` at Llama-3-8B's size (q/k/v/gate/up column-parallel, o/down
row-parallel, the paged pool sharded over the 8 KV heads) and DeepSeek-V3's MLA layer (the latent
replicated, 16 of the 128 query heads per chip), TP 8 on ``v5e:2x4`` and ``v6e:2x4``; attention
through ``kvjax.attention.attend`` (the Pallas kernel inside ``shard_map``), the step jitted with
explicit shardings and the pool donated. From the compiled program:

* the Mosaic kernels are there (``tpu_custom_call``);
* the pool is updated in place: the aliased bytes cover the pool's per-chip shard;
* per-chip temporaries stay below ``MAX_TEMP_BYTES`` (see there);
* the collectives are Megatron's minimum: two all-reduces of ``tokens x hidden`` bf16 per layer,
  nothing else (no all-gather of a weight, no resharding of the pool).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)

TOPOLOGIES = ["v5e:2x4", "v6e:2x4"]
LAYERS = ["llama-3-8b", "deepseek-v3-mla"]

#: Per-chip temporaries of one layer step. What a step holds besides its arguments are a few
#: activations: ``[tokens, hidden]`` bf16 (64 x 7168 x 2 = 896 KiB at the larger model) and
#: ``[tokens, intermediate / 8]`` (64 x 2304 x 4 = 576 KiB in f32), the queries of 16 heads
#: (64 x 16 x 640 x 4 = 2.5 MiB for MLA's padded latent rows). 8 MiB allows a few of each; the
#: pool's shard is 256 MiB, so any copy of it (a pool that is not updated in place) fails.
MAX_TEMP_BYTES = 8 << 20


def _shape(name: str) -> Any:
    from kvjax.serve import sharded_layer_probe as probe

    return {"llama-3-8b": probe.LLAMA_3_8B, "deepseek-v3-mla": probe.DEEPSEEK_V3}[name]


@functools.cache
def _compiled(topology: str, layer: str) -> tuple[Any, str, Any]:
    """(mesh, compiled text, memory analysis) of one layer step, compiled once per module run."""
    from jax.experimental import topologies

    from kvjax.serve import sharded_layer_probe as probe

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = probe.tp_mesh(devices)
    shape = _shape(layer)
    compiled = probe.jit_layer_step(shape, mesh).trace(*probe.layer_inputs(shape, mesh)).lower().compile()
    return mesh, compiled.as_text(), compiled.memory_analysis()


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_layer_step_runs_mosaic_in_place_with_small_temporaries(topology: str, layer: str) -> None:
    from kvjax.serve import sharded_layer_probe as probe

    mesh, text, memory = _compiled(topology, layer)
    assert mesh.size == 8
    assert 'custom_call_target="tpu_custom_call"' in text, f"{layer} on {topology}: no Mosaic kernel"
    assert "input_output_alias" in text, "the donated pool must be aliased to the output"
    pool = probe.pool_bytes_per_device(_shape(layer), mesh)
    assert pool > 255 << 20, f"a pool of about 256 MiB per chip, not {pool} bytes"
    assert memory.alias_size_in_bytes >= pool, (
        f"{layer} on {topology}: {memory.alias_size_in_bytes} bytes aliased, the pool's shard is {pool}"
    )
    assert memory.temp_size_in_bytes <= MAX_TEMP_BYTES, (
        f"{layer} on {topology}: {memory.temp_size_in_bytes} bytes of temporaries (limit {MAX_TEMP_BYTES})"
    )


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_layer_step_needs_exactly_megatrons_two_all_reduces(topology: str, layer: str) -> None:
    from kvjax.serve import sharded_layer_probe as probe

    _mesh, text, _memory = _compiled(topology, layer)
    shape = _shape(layer)
    found = probe.collectives(text)
    assert [c.op for c in found] == ["all-reduce", "all-reduce"], found
    activation = shape.tokens * shape.hidden * 2  # [tokens, hidden] bf16
    assert [c.nbytes for c in found] == [activation, activation], found
    assert sum(c.nbytes for c in found) == probe.megatron_all_reduce_bytes(shape)
