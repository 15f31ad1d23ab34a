"""The serving step over 8-chip TPU slices, compiled without a TPU: the real step
(``kvjax.serve.step.make_sharded_step``) of a two-layer model with Llama-3-8B's layer sizes and
of one with DeepSeek-V3's MLA layer sizes (``kvjax.serve.abstract_step``: abstract pools, weights
and a decode batch of 64 sequences at 2k context, with their shardings), TP 8 on ``v5e:2x4`` and
``v6e:2x4``. From the compiled program (``kvjax.serve.compiled_step``):

* the Mosaic kernels are there (``tpu_custom_call``), one attention kernel per layer at least;
* every pool buffer is donated and aliased to an output (updated in place): each pool parameter
  is in ``input_output_alias`` and the aliased bytes cover the pools' per-chip shards;
* per-chip temporaries stay below ``MAX_TEMP_BYTES`` (see there), a few percent of the pools;
* the collectives are Megatron's minimum: per layer one all-reduce of ``tokens x hidden`` after
  attention and one after the MLP, nothing else; none outside the layers (the embedding and the
  LM head are replicated, so the logits need no collective).

The MLA latent is replicated over TP (as sglang-jax does): every chip holds the whole latent
pool, 8 times what a split would hold, and needs no collective for it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)

TOPOLOGIES = ["v5e:2x4", "v6e:2x4"]
MODELS = ["llama-3-8b", "deepseek-v3-mla"]
LAYERS = 2
TP = 8

#: Per-chip temporaries of the step. What it holds besides its arguments are activations:
#: ``[tokens, hidden]`` bf16 (64 x 7168 x 2 = 896 KiB at the larger model), ``[tokens,
#: intermediate / 8]`` (64 x 2304 x 4 = 576 KiB in f32), the queries of 16 heads (64 x 16 x 640 x 4 =
#: 2.5 MiB for MLA's padded latent rows), the logits ([64, 4096] f32 = 1 MiB). 8 MiB allows a few of
#: each; one layer's pool shard is 256 MiB (Llama) or 160 MiB (the MLA latent), so any copy of a
#: pool (one not updated in place) fails.
MAX_TEMP_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class Compiled:
    spec: Any
    tokens: int
    pool_bytes: int
    text: str
    memory: Any


def _target(model: str) -> tuple[Any, Any]:
    """(spec, cache config) of a compile target: Llama's pool 2 GiB per layer (256 MiB per chip),
    the MLA latent 160 MiB per layer on every chip."""
    from kvjax import CacheConfig
    from kvjax.serve.abstract_step import DEEPSEEK_V3_AS_V2, sized_like

    if model == "llama-3-8b":
        spec = sized_like("llama-3-8b", num_layers=LAYERS, vocab_size=4096)
        return spec, CacheConfig(tp_size=TP, page_size=16, max_total_tokens=1 << 19, context_length=2048)
    spec = sized_like("deepseek-v3", num_layers=LAYERS, vocab_size=4096, **DEEPSEEK_V3_AS_V2)
    return spec, CacheConfig(tp_size=TP, page_size=64, max_total_tokens=1 << 17, context_length=2048)


@functools.cache
def _compiled(topology: str, model: str) -> Compiled:
    """The step of ``model`` compiled for ``topology``, once per module run."""
    from kvjax.serve.abstract_step import (
        DecodeBatch,
        abstract_step_inputs,
        bytes_per_device,
        lower_sharded_step,
        topology_mesh,
    )

    spec, config = _target(model)
    mesh = topology_mesh(topology)
    assert mesh.size == TP
    inputs = abstract_step_inputs(spec, config, mesh, DecodeBatch(seqs=64, context=2048))
    compiled = lower_sharded_step(spec, mesh, inputs).compile()
    tokens = inputs.tokens.shape[0]
    return Compiled(spec, tokens, bytes_per_device(inputs.pools), compiled.as_text(), compiled.memory_analysis())


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_step_runs_mosaic_with_every_pool_in_place_and_small_temporaries(topology: str, model: str) -> None:
    from kvjax.serve.compiled_step import aliased_parameters, entry_parameters, mosaic_kernels

    step = _compiled(topology, model)
    assert mosaic_kernels(step.text) >= LAYERS, f"{model} on {topology}: no Mosaic attention kernel per layer"
    parameters = entry_parameters(step.text)
    pools = {n for n, name in parameters.items() if name.startswith("pools")}
    assert len(pools) >= LAYERS, parameters
    missing = sorted(parameters[n] for n in pools - aliased_parameters(step.text))
    assert not missing, f"{model} on {topology}: pool buffers not aliased to an output: {missing}"
    assert step.memory.alias_size_in_bytes >= step.pool_bytes, (
        f"{model} on {topology}: {step.memory.alias_size_in_bytes} bytes aliased; the pools' shards: {step.pool_bytes}"
    )
    assert step.memory.temp_size_in_bytes <= MAX_TEMP_BYTES, (
        f"{model} on {topology}: {step.memory.temp_size_in_bytes} bytes of temporaries (limit {MAX_TEMP_BYTES})"
    )


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_step_needs_exactly_megatrons_two_all_reduces_per_layer(topology: str, model: str) -> None:
    from kvjax.serve.compiled_step import collectives, megatron_all_reduce_bytes_per_layer
    from kvjax.serve.model import as_model_config

    step = _compiled(topology, model)
    config = as_model_config(step.spec)
    found = collectives(step.text)
    outside = [c for c in found if c.layer is None]
    assert not outside, f"collectives outside the layers (embedding, LM head, sampling): {outside}"
    activation = step.tokens * config.hidden_size * 2  # [tokens, hidden] bf16
    for layer in range(LAYERS):
        mine = [c for c in found if c.layer == layer]
        assert [(c.op, c.nbytes) for c in mine] == [("all-reduce", activation)] * 2, mine
        assert "o_proj" in mine[0].op_name and "down_proj" in mine[1].op_name, mine
        assert sum(c.nbytes for c in mine) == megatron_all_reduce_bytes_per_layer(
            step.tokens, config.hidden_size, config.dtype
        )
    assert len(found) == 2 * LAYERS


def test_the_mla_latent_is_whole_on_every_chip() -> None:
    step = _compiled(TOPOLOGIES[0], "deepseek-v3-mla")
    spec = step.spec
    row = 640  # kv_lora_rank 512 + rope 64, padded to a multiple of 128 lanes on TPU
    latent_bytes = LAYERS * ((1 << 17) + 64) * row * 2  # every page plus the trash page, bf16
    assert spec.kv_lora_rank + spec.qk_rope_head_dim == 576
    assert step.pool_bytes - latent_bytes < 4096, (step.pool_bytes, latent_bytes)  # plus the per-layer scales
