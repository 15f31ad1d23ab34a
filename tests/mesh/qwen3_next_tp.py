"""What the Qwen3-Next tensor-parallel parity files share (``test_tp_parity_qwen3_next.py`` at tp 2,
``test_tp_parity_qwen3_next_tp4.py`` at tp 4; two files so the mesh stage's two workers run them
side by side): the tiny model's layers, its gated delta net heads per tp, its checkpoint, and the
served check.

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

from tests.mesh.tp_serving import serve_recurrent_over_tp
from tests.serve.parity_harness import TINY_CONFIG, assert_matches_transformers, tiny_checkpoint, transformers
from tests.serve.test_parity_qwen3_next import MODEL_SEED

MAX_NEW = 6
ATOL = 1e-4

LAYERS: dict[str, Any] = dict(
    intermediate_size=128,
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_only_layers=[0, 1, 2, 3],
    num_experts=0,
)
HEADS: dict[int, dict[str, int]] = {
    # tp: the gated delta net's heads (key heads divide over tp; 2 value heads per key head)
    2: dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    4: dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8),
}


def qwen3_next_checkpoint(tp: int, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """``(Transformers model, kvjax's load)`` of the tiny Qwen3-Next whose key heads divide over ``tp``
    (2 or 4)."""
    config = transformers.Qwen3NextConfig(**TINY_CONFIG, **LAYERS, **HEADS[tp])
    return tiny_checkpoint(config, tmp_path_factory, f"qwen3_next_tp{tp}", seed=MODEL_SEED)


def check_head_parallel_serving(tp: int, hf: Any, model: Any) -> None:
    """Serve the parity rounds over a ``tp`` mesh through a cache small enough to reuse, evict and
    retract (each asserted), the recurrent state pool and the gated delta net's weights split over
    ``"tp"`` by key heads (asserted), and every request's tokens and logits equal Transformers'."""
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
