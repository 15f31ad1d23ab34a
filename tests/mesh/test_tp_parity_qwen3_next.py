"""Qwen3-Next (gated delta net layers and a full-attention layer) at tp 2 over CPU devices gives
Transformers' tokens and logits through prefix reuse from state checkpoints, chunked prefill,
eviction of KV and checkpoints, and retraction (each asserted).

The recurrent state pool is sharded over its heads (``kvjax.pools.recurrent``: each rank holds
its half of the conv channels and of the SSM heads); the recurrence gathers the batch rows' states
and runs on every rank (``kvjax.attention.recurrent_step``). tp 4 is refused at planning: the 2
key-head groups do not split over 4 ranks (SGLang refuses that split too).
"""

from __future__ import annotations

from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_matches_transformers,
    serve_recurrent,
    tiny_checkpoint,
    transformers,
)
from tests.serve.test_parity_qwen3_next import LOGIT_ATOL, MODEL_SEED

MAX_NEW = 6

QWEN3_NEXT = dict(
    intermediate_size=128,
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_only_layers=[0, 1, 2, 3],
    num_experts=0,
)


def test_recurrent_state_split_over_heads_reuse_eviction_and_retraction(tmp_path_factory):
    tp = 2
    config = transformers.Qwen3NextConfig(**TINY_CONFIG, **QWEN3_NEXT)
    hf, model = tiny_checkpoint(config, tmp_path_factory, "qwen3_next", seed=MODEL_SEED)
    sched, done = serve_recurrent(
        model,
        MAX_NEW,
        mesh=mesh_of(tp),
        tp_size=tp,
        max_total_tokens=56,
        max_running_requests=4,
        max_mamba_cache_size=6,
    )
    assert_sharded(sched, tp)
    assert all(a.sharding.spec[2] == "tp" for a in (*sched.cache.pools.recurrent.conv, sched.cache.pools.recurrent.ssm))
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
