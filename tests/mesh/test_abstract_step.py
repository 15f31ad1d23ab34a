"""``kvjax.serve.abstract_step`` gives what serving builds, without building it: on a 2-device CPU
mesh the abstract pools, weights and decode batch have the shapes, dtypes and shardings of the
arrays ``build_kv_cache`` / ``place_on_mesh`` / the metadata builder make, and the step lowered
over them compiles to the program ``kvjax.serve.compiled_step`` reads (two all-reduces per layer,
every pool aliased). Bad input is refused by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.serve import compiled_step
from kvjax.serve.abstract_step import (
    DecodeBatch,
    abstract_step_inputs,
    bytes_per_device,
    decode_batch,
    lower_sharded_step,
    sized_like,
)
from kvjax.serve.model import as_model_config, init_params
from kvjax.serve.step import place_on_mesh

TP = 2
BATCH = DecodeBatch(seqs=3, context=40)
CONFIG = CacheConfig(tp_size=TP, max_total_tokens=256, context_length=64, max_running_requests=4)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])


def _same_layout(abstract: object, built: object) -> bool:
    """Same shapes and dtypes, and shardings that place every element alike."""
    pairs = list(zip(jax.tree.leaves(abstract), jax.tree.leaves(built), strict=True))
    return all(
        a.shape == b.shape
        and np.dtype(a.dtype) == np.dtype(b.dtype)
        and a.sharding.is_equivalent_to(b.sharding, a.ndim)
        for a, b in pairs
    )


def test_abstract_inputs_are_what_serving_builds() -> None:
    spec, mesh = ModelSpec.preset("tiny"), _mesh()
    inputs = abstract_step_inputs(spec, CONFIG, mesh, BATCH)
    cache = build_kv_cache(spec, CONFIG, mesh=mesh)
    pools, params = place_on_mesh(spec, cache.pools, init_params(spec), mesh)
    assert jax.tree.structure(inputs.pools) == jax.tree.structure(pools)
    assert _same_layout(inputs.pools, pools)
    assert jax.tree.structure(inputs.params) == jax.tree.structure(params)
    assert _same_layout(inputs.params, params)
    assert bytes_per_device(inputs.pools) == sum(
        leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(pools)
    )
    tokens, meta = decode_batch(BATCH, cache.plan.page_size, cache.plan.max_total_tokens)
    assert inputs.tokens.shape == tokens.shape
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(inputs.meta)] == [
        (np.shape(a), np.asarray(a).dtype) for a in jax.tree.leaves(meta)
    ]
    assert list(meta.kv_lens[: BATCH.seqs]) == [BATCH.context] * BATCH.seqs


def test_the_lowered_step_compiles_to_megatrons_collectives_with_the_pools_aliased() -> None:
    spec, mesh = ModelSpec.preset("tiny"), _mesh()
    inputs = abstract_step_inputs(spec, CONFIG, mesh, BATCH)
    text = lower_sharded_step(spec, mesh, inputs).compile().as_text()
    config = as_model_config(spec)
    found = compiled_step.collectives(text)
    assert compiled_step.count_by_layer(found) == {layer: 2 for layer in range(config.num_hidden_layers)}, found
    tokens = inputs.tokens.shape[0]
    minimum = compiled_step.megatron_all_reduce_bytes_per_layer(tokens, config.hidden_size, config.dtype)
    for layer in range(config.num_hidden_layers):
        assert sum(c.nbytes for c in found if c.layer == layer) == minimum
    names = compiled_step.entry_parameters(text)
    pools = {n for n, name in names.items() if name.startswith("pools")}
    assert pools and pools <= compiled_step.aliased_parameters(text), names


def test_bad_input_is_refused_by_name() -> None:
    mesh = _mesh()
    with pytest.raises(ValueError, match="the pool has 256"):
        abstract_step_inputs(ModelSpec.preset("tiny"), CONFIG, mesh, DecodeBatch(seqs=5, context=64))
    with pytest.raises(ValueError, match="only device pool is 'kv'"):
        abstract_step_inputs(ModelSpec.preset("gemma3-tiny"), CONFIG, mesh, BATCH)
    with pytest.raises(ValueError, match="seqs=0"):
        DecodeBatch(seqs=0, context=8)
    small = sized_like("llama-3-8b", num_layers=1, vocab_size=256)
    assert small.num_hidden_layers == 1 and small.vocab_size == 256 and small.num_kv_heads == 8
