"""The sharded step's collectives, counted in its compiled program at tp 2 on CPU: Megatron's
minimum, one all-reduce of the hidden state after attention (or after Qwen3-Next's head-parallel
gated delta net) and one after the MLP per layer (a sparse-MoE layer's routed experts, split by
their intermediate dimension, and its shared experts together: one), and the pools updated in
place (donated, aliased to the outputs, still sharded over KV heads / state heads).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.attention import StateMetadata, build_attention_metadata
from kvjax.attention.sharding import serving_mesh
from kvjax.serve.model import as_model_config, init_params
from kvjax.serve.moe import SparseMoE
from kvjax.serve.param_sharding import (
    gated_delta_conv_channel_order,
    param_partition_specs,
    relayout_params,
    shard_params,
)
from kvjax.serve.step import make_sharded_step, place_on_mesh
from tests.serve.random_workloads import NEMOTRON_H_TINY, QWEN3_NEXT_TINY, TINY_SIZES, VOCAB

TP = 2
TOKENS = 5
MAX_SEQS = 4


def _qwen3_next() -> ModelSpec:
    return ModelSpec.from_hf_config(QWEN3_NEXT_TINY, name="qwen3-next-tiny")


# DeepSeek-V3's layers in small: MLA, a dense first layer, then sparse-MoE layers (4 routed experts
# of intermediate 32, one shared expert).
DEEPSEEK_V3_MOE_TINY: dict = dict(
    TINY_SIZES,
    model_type="deepseek_v3",
    vocab_size=VOCAB,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    routed_scaling_factor=1.5,
    rope_scaling=None,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
# Qwen3-Next with sparse-MoE layers (4 routed experts, a gated shared expert).
QWEN3_NEXT_MOE_TINY: dict = dict(
    QWEN3_NEXT_TINY,
    mlp_only_layers=[],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,  # two experts' worth
    decoder_sparse_step=1,
    norm_topk_prob=True,
)

_SPECS = {
    "tiny": lambda: ModelSpec.preset("tiny"),
    "qwen3_next": _qwen3_next,
    "nemotron_h": lambda: ModelSpec.from_hf_config(NEMOTRON_H_TINY, name="nemotron-h-tiny"),
    "deepseek_v3_moe": lambda: ModelSpec.from_hf_config(DEEPSEEK_V3_MOE_TINY, name="deepseek-v3-moe-tiny"),
    "qwen3_next_moe": lambda: ModelSpec.from_hf_config(QWEN3_NEXT_MOE_TINY, name="qwen3-next-moe-tiny"),
}


def _sharded_step_inputs(spec: ModelSpec | None = None) -> tuple:
    spec = spec or ModelSpec.preset("tiny")
    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
    page = 1 if spec.recurrent is not None else 16  # a recurrent-state tree needs pages of 1 token
    config = CacheConfig(tp_size=TP, max_total_tokens=256, context_length=64, page_size=page)
    cache = build_kv_cache(spec, config, mesh=mesh)
    pools, params = place_on_mesh(spec, cache.pools, init_params(spec), mesh)
    slots = cache.allocator.alloc_extend(np.array([0]), np.array([TOKENS]), np.array([-1]))
    [row] = cache.req_to_token_pool.alloc(1)
    cache.req_to_token_pool.write(row, 0, slots)
    table = cache.req_to_token_pool.page_table_numpy([row], [TOKENS], page, 64 // page)
    tokens, meta = build_attention_metadata(
        tokens=[np.arange(TOKENS, dtype=np.int32)], starts=[0], slots=slots, page_table=table, max_seqs=MAX_SEQS
    )
    if "recurrent" in pools:  # one sequence starting from zero state in slot 1
        zeros = np.zeros(MAX_SEQS, np.int32)
        slot = np.array([1, 0, 0, 0], np.int32)
        meta = meta.with_parts(
            StateMetadata(state_slots=slot, has_initial_state=zeros, track_slots=zeros, track_at=zeros)
        )
    return spec, mesh, pools, params, tokens, meta


@pytest.mark.parametrize(
    ("model", "per_layer"),
    [("tiny", 2), ("qwen3_next", 2), ("nemotron_h", 1), ("deepseek_v3_moe", 2), ("qwen3_next_moe", 2)],
)
def test_one_all_reduce_after_attention_and_one_after_the_mlp_per_layer(model, per_layer):
    """Qwen3-Next: its gated-delta-net layers, head-parallel, need one all-reduce too (after
    ``out_proj``), its full-attention layer one, and every dense MLP one. Nemotron-H's blocks hold
    one mixer each (a head-parallel Mamba2, attention or an MLP): one all-reduce per block. A
    sparse-MoE layer (DeepSeek-V3's, Qwen3-Next's with its gated shared expert) needs one too: its
    routed experts' and shared experts' partial sums are added before the sum over ranks."""
    spec, mesh, pools, params, tokens, meta = _sharded_step_inputs(_SPECS[model]())
    step = make_sharded_step(spec, mesh, pools)
    compiled = step.jitted.lower(pools, params, tokens, meta, None, None).compile()
    text = compiled.as_text()
    all_reduces = re.findall(r"= \S+ all-reduce(?:-start)?\(", text)
    layers = as_model_config(spec).num_hidden_layers
    assert len(all_reduces) == per_layer * layers, f"{len(all_reduces)} all-reduces, {layers} layers:\n" + "\n".join(
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


def test_the_recurrent_state_stays_sharded_and_is_written_in_place():
    spec, mesh, pools, params, tokens, meta = _sharded_step_inputs(_qwen3_next())
    before = pools.recurrent.ssm
    pointers = [s.data.unsafe_buffer_pointer() for s in before.addressable_shards]
    new_pools, _ = make_sharded_step(spec, mesh, pools)(pools, params, tokens, meta)
    assert before.is_deleted(), "the pools are donated"
    after = new_pools.recurrent.ssm
    assert after.sharding.spec == P(None, None, "tp")
    assert [s.data.unsafe_buffer_pointer() for s in after.addressable_shards] == pointers, "written in place"
    assert float(np.abs(np.asarray(after[:, 1])).sum()) > 0, "slot 1 holds the sequence's state"


def test_gated_delta_net_weights_split_by_key_heads_and_conv_channels_relaid_rank_major():
    spec = _qwen3_next()
    config = as_model_config(spec)
    params = init_params(spec)
    mixer = param_partition_specs(params, config, TP)["model"]["layers_0"]["linear_attn"]
    assert mixer["in_proj_qkvz"]["weight"] == P("tp", None) and mixer["in_proj_ba"]["weight"] == P("tp", None)
    assert mixer["conv1d"]["weight"] == P("tp", None, None)
    assert mixer["A_log"] == P("tp") and mixer["dt_bias"] == P("tp")
    assert mixer["out_proj"]["weight"] == P(None, "tp") and mixer["norm"]["weight"] == P()
    # 2 key heads of 16 (q, k) and 4 value heads of 16 (v): conv channels [q 0:32, k 32:64, v 64:128].
    order = gated_delta_conv_channel_order(2, 16, 4, 16, TP)
    want = [*range(0, 16), *range(32, 48), *range(64, 96), *range(16, 32), *range(48, 64), *range(96, 128)]
    assert order.tolist() == want
    assert gated_delta_conv_channel_order(2, 16, 4, 16, 1).tolist() == list(range(128))
    with pytest.raises(ValueError, match="2 key heads do not split over 4 ranks"):
        gated_delta_conv_channel_order(2, 16, 4, 16, 4)
    conv = np.asarray(params["model"]["layers_0"]["linear_attn"]["conv1d"]["weight"])
    relaid = relayout_params(params, config, TP)
    np.testing.assert_array_equal(
        np.asarray(relaid["model"]["layers_0"]["linear_attn"]["conv1d"]["weight"]), conv[want]
    )
    q_proj = params["model"]["layers_2"]["self_attn"]["q_proj"]["weight"]
    assert relaid["model"]["layers_2"]["self_attn"]["q_proj"]["weight"] is q_proj, "only re-laid weights change"
    assert relayout_params(params, config, 1) is params
    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
    placed = shard_params(params, config, mesh)
    again = shard_params(placed, config, mesh)
    assert again is placed, "placed weights are not re-laid out twice"
    np.testing.assert_array_equal(
        np.asarray(placed["model"]["layers_0"]["linear_attn"]["conv1d"]["weight"]), conv[want]
    )


@pytest.mark.parametrize("model", ["deepseek_v3_moe", "qwen3_next_moe"])
def test_routed_experts_are_split_by_their_intermediate_dimension(model):
    """Every routed expert's ``gate_proj``/``up_proj`` split by rows and ``down_proj`` by columns
    (``moe_intermediate_size`` over the ranks), the shared experts likewise, the router and the
    shared expert's gate replicated; placed so, each device holds ``1 / tp`` of every expert.
    Replicated when ``moe_intermediate_size`` does not split (32 over 64 ranks)."""
    spec = _SPECS[model]()
    config = as_model_config(spec)
    params = init_params(spec)
    moe_layer = "layers_1" if model == "deepseek_v3_moe" else "layers_0"
    mlp = param_partition_specs(params, config, TP)["model"][moe_layer]["mlp"]
    experts = [name for name in mlp if name.startswith("experts_")]
    assert len(experts) == 4
    for name in experts:
        assert mlp[name]["gate_proj"]["weight"] == P("tp", None), name
        assert mlp[name]["up_proj"]["weight"] == P("tp", None), name
        assert mlp[name]["down_proj"]["weight"] == P(None, "tp"), name
    shared = "shared_experts" if model == "deepseek_v3_moe" else "shared_expert"
    assert mlp[shared]["gate_proj"]["weight"] == P("tp", None) and mlp[shared]["down_proj"]["weight"] == P(None, "tp")
    assert mlp["gate"]["weight"] == P()
    if model == "qwen3_next_moe":
        assert mlp["shared_expert_gate"]["weight"] == P()
    wide = param_partition_specs(params, config, 64)["model"][moe_layer]["mlp"]
    assert wide["experts_0"]["gate_proj"]["weight"] == P() and wide["experts_0"]["down_proj"]["weight"] == P()
    mesh = serving_mesh(jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP]))
    placed = shard_params(params, config, mesh)["model"][moe_layer]["mlp"]
    for name, shard in (("gate_proj", (16, 64)), ("up_proj", (16, 64)), ("down_proj", (64, 16))):
        assert [s.data.shape for s in placed["experts_3"][name]["weight"].addressable_shards] == [shard] * TP, name
    # the block over the split weights gives the unsplit block's output
    block = SparseMoE(config.family_config.moe, jnp.float32)
    x = np.random.default_rng(0).standard_normal((TOKENS, config.hidden_size)).astype(np.float32)
    want = block.apply({"params": params["model"][moe_layer]["mlp"]}, x)
    got = jax.jit(block.apply)({"params": placed}, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
