"""The sharded step's collectives, counted in its compiled program at tp 2 on CPU: Megatron's
minimum, one all-reduce of the hidden state after attention and one after the MLP per layer, and
the pools updated in place (donated, aliased to the outputs, still sharded over KV heads).
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.attention import build_attention_metadata
from kvjax.serve.model import as_model_config, init_params
from kvjax.serve.param_sharding import param_partition_specs, shard_params
from kvjax.serve.step import make_sharded_step, place_on_mesh

TP = 2
TOKENS = 5


def _sharded_step_inputs() -> tuple:
    spec = ModelSpec.preset("tiny")
    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
    cache = build_kv_cache(spec, CacheConfig(tp_size=TP, max_total_tokens=256, context_length=64), mesh=mesh)
    pools, params = place_on_mesh(spec, cache.pools, init_params(spec), mesh)
    slots = cache.allocator.alloc_extend(np.array([0]), np.array([TOKENS]), np.array([-1]))
    [row] = cache.req_to_token_pool.alloc(1)
    cache.req_to_token_pool.write(row, 0, slots)
    table = cache.req_to_token_pool.page_table_numpy([row], [TOKENS], 16, 4)
    tokens, meta = build_attention_metadata(
        tokens=[np.arange(TOKENS, dtype=np.int32)], starts=[0], slots=slots, page_table=table, max_seqs=4
    )
    return spec, mesh, pools, params, tokens, meta


def test_one_all_reduce_after_attention_and_one_after_the_mlp_per_layer():
    spec, mesh, pools, params, tokens, meta = _sharded_step_inputs()
    step = make_sharded_step(spec, mesh, pools)
    compiled = step.jitted.lower(pools, params, tokens, meta, None, None).compile()
    text = compiled.as_text()
    all_reduces = re.findall(r"= \S+ all-reduce(?:-start)?\(", text)
    layers = as_model_config(spec).num_hidden_layers
    assert len(all_reduces) == 2 * layers, f"{len(all_reduces)} all-reduces for {layers} layers:\n" + "\n".join(
        line for line in text.splitlines() if "all-reduce" in line
    )
    hidden = as_model_config(spec).hidden_size
    shapes = re.findall(r"= (\S+) all-reduce(?:-start)?\(", text)
    assert all(f",{hidden}]" in s for s in shapes), shapes  # [tokens, hidden] partial sums
    assert not re.search(r"all-gather|all-to-all|collective-permute", text), "only the two all-reduces move data"


def test_the_pools_stay_sharded_and_are_written_in_place():
    spec, mesh, pools, params, tokens, meta = _sharded_step_inputs()
    before = pools.kv.kv[0]
    pointers = [s.data.unsafe_buffer_pointer() for s in before.addressable_shards]
    new_pools, next_tokens = make_sharded_step(spec, mesh, pools)(pools, params, tokens, meta)
    assert before.is_deleted(), "the pools are donated"
    after = new_pools.kv.kv[0]
    assert after.sharding.spec == P(None, None, "tp", None)
    assert [s.data.unsafe_buffer_pointer() for s in after.addressable_shards] == pointers, "written in place"
    assert next_tokens.shape == (4,)


def test_weights_are_split_megatron_style():
    spec = ModelSpec.preset("tiny")
    config = as_model_config(spec)
    specs = param_partition_specs(init_params(spec), config, TP)
    attn, mlp = specs["model"]["layers_0"]["self_attn"], specs["model"]["layers_0"]["mlp"]
    for name in ("q_proj", "k_proj", "v_proj"):
        assert attn[name]["weight"] == P("tp", None)
    assert attn["o_proj"]["weight"] == P(None, "tp")
    assert mlp["gate_proj"]["weight"] == P("tp", None) and mlp["up_proj"]["weight"] == P("tp", None)
    assert mlp["down_proj"]["weight"] == P(None, "tp")
    assert specs["model"]["embed_tokens"]["weight"] == P() and specs["lm_head"]["weight"] == P()
    # 4 ranks exceed the 2 KV heads: their projections are replicated (each rank keeps its head).
    wide = param_partition_specs(init_params(spec), config, 4)["model"]["layers_0"]["self_attn"]
    assert wide["k_proj"]["weight"] == P() and wide["q_proj"]["weight"] == P("tp", None)
    placed = shard_params(init_params(spec), config, jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP]))
    assert placed["model"]["layers_0"]["mlp"]["down_proj"]["weight"].sharding.spec == P(None, "tp")
