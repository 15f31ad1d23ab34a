"""Qwen3-Next (gated delta net layers and a full-attention layer) at tp 2 and tp 4 over CPU devices
gives Transformers' tokens and logits (within 1e-4, float32) through prefix reuse from state
checkpoints, chunked prefill, eviction of KV and checkpoints, and retraction (each asserted).

The gated delta net runs head-parallel (``kvjax.attention.recurrent_step.recurrent_mixer_over_heads``):
each rank projects, convolves and runs the delta rule for its own key heads and their value heads
over its own shard of the recurrent state pool, and one all-reduce sums ``out_proj``'s partial
products. Its weights are split by key heads (``kvjax.serve.param_sharding``), the conv channels
re-laid out rank-major at load. Each rank needs whole key heads, so the tp 2 model (2 key heads)
cannot run at tp 4 (refused at planning, as SGLang refuses it) and the tp 4 model has 4.
"""

from __future__ import annotations

from typing import Any

import pytest
from jax.sharding import PartitionSpec as P

from kvjax import CacheConfig, build_kv_cache
from kvjax.errors import ConfigError
from tests.mesh.tp_serving import mesh_of, serve_recurrent_over_tp
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_matches_transformers,
    tiny_checkpoint,
    transformers,
)
from tests.serve.test_parity_qwen3_next import MODEL_SEED

MAX_NEW = 6
ATOL = 1e-4

_LAYERS = dict(
    intermediate_size=128,
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_only_layers=[0, 1, 2, 3],
    num_experts=0,
)
HEADS = {
    # tp: the gated delta net's heads (key heads divide over tp; 2 value heads per key head)
    2: dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    4: dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8),
}


@pytest.fixture(scope="module")
def checkpoints() -> dict[int, tuple[Any, Any]]:
    """Built on first use per tp: ``(Transformers model, kvjax's load)``."""
    return {}


def _checkpoint(tp: int, checkpoints: dict, tmp_path_factory) -> tuple[Any, Any]:
    if tp not in checkpoints:
        config = transformers.Qwen3NextConfig(**TINY_CONFIG, **_LAYERS, **HEADS[tp])
        checkpoints[tp] = tiny_checkpoint(config, tmp_path_factory, f"qwen3_next_tp{tp}", seed=MODEL_SEED)
    return checkpoints[tp]


@pytest.mark.timeout(600)  # ~2 min on a quiet machine; shared CPUs stretch it
@pytest.mark.parametrize("tp", [2, 4])
def test_head_parallel_gated_delta_net_reuse_eviction_and_retraction(tp, checkpoints, tmp_path_factory):
    hf, model = _checkpoint(tp, checkpoints, tmp_path_factory)
    sched, done = serve_recurrent_over_tp(model, MAX_NEW, tp)
    state = sched.cache.pools.recurrent
    assert all(a.sharding.spec[2] == "tp" for a in (*state.conv, state.ssm))
    mixer = sched.params["model"]["layers_0"]["linear_attn"]
    for name in ("in_proj_qkvz", "in_proj_ba", "conv1d"):
        assert mixer[name]["weight"].sharding.spec[0] == "tp", name
    assert mixer["out_proj"]["weight"].sharding.spec == P(None, "tp")
    assert mixer["A_log"].sharding.spec == P("tp") and mixer["norm"]["weight"].sharding.spec == P()
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_key_heads_that_do_not_divide_are_refused_before_anything_is_built(checkpoints, tmp_path_factory):
    _, model = _checkpoint(2, checkpoints, tmp_path_factory)
    with pytest.raises(ConfigError, match="tp_size"):
        build_kv_cache(model.spec, CacheConfig(tp_size=4, max_total_tokens=56, context_length=64), mesh=mesh_of(4))
