"""DeepSeek-V3 served through kvjax matches Transformers.

A tiny random-weight ``DeepseekV3ForCausalLM`` (float32): MLA with the low-rank query path, a
dense first layer then sparse-MoE layers with V3's router (sigmoid scores, ``noaux_tc`` over 2
groups with a random ``e_score_correction_bias``, so the bias moves the choice; weights normalised
and scaled by ``routed_scaling_factor``), one shared expert, interleaved RoPE (``rope_interleave``),
and one MTP layer's worth of config (``num_nextn_predict_layers``, unused here). Served by the
parity rounds (shared system prompt, a two-turn chat, chunked prefill of 8) at page size 1 with a
pool small enough to evict and retract: every request's greedy tokens equal Transformers'
``generate`` and its logits agree within ``LOGIT_ATOL``. ``tests/mesh/test_deepseek_v3_composition.py``
serves the same model across processes with its MTP layer drafting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvjax import ModelSpec
from kvjax.errors import ConfigError
from kvjax.pools import MLAKVPool
from kvjax.serve.checkpoint import load_checkpoint
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_matches_transformers,
    build_scheduler,
    random_transformers_model,
    serve_two_rounds,
    torch,
    transformers,
)

LOGIT_ATOL = 1e-4
MAX_NEW = 6

CONFIG: dict[str, Any] = dict(
    TINY_CONFIG,
    num_attention_heads=8,  # splits over tp 8 (the composition test)
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
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
    num_nextn_predict_layers=1,
    rope_scaling=None,
    tie_word_embeddings=False,
)


def deepseek_v3_checkpoint(directory: Path) -> Any:
    """Transformers' tiny DeepSeek-V3 (``CONFIG``, random weights, a random router bias), saved
    into ``directory``."""
    hf = random_transformers_model(transformers.DeepseekV3Config(**CONFIG))
    with torch.no_grad():  # Transformers initialises the router bias to 0: draw one that moves the choice
        generator = torch.Generator().manual_seed(3)
        for layer in hf.model.layers[CONFIG["first_k_dense_replace"] :]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.5)
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> tuple[Any, Path]:
    directory = tmp_path_factory.mktemp("deepseek_v3")
    return deepseek_v3_checkpoint(directory), directory


def test_page_1_with_a_pool_small_enough_to_evict_and_retract(deepseek_v3):
    hf, directory = deepseek_v3
    model = load_checkpoint(directory)
    moe = model.config.family_config.moe
    assert (moe.topk_method, moe.scoring, moe.norm_topk_prob) == ("noaux_tc", "sigmoid", True)
    sched = build_scheduler(model, page_size=1, max_total_tokens=64, max_running_requests=8)
    assert isinstance(sched.cache.pools.kv, MLAKVPool)
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0 and sched.stats.cached_tokens > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_a_non_interleaved_rope_is_refused_by_name():
    from kvjax.serve.families.deepseek_v2 import read_config

    raw = dict(CONFIG, model_type="deepseek_v3", rope_interleave=False)
    with pytest.raises(ConfigError, match="rope_interleave"):
        read_config(ModelSpec.preset("deepseek-tiny"), raw)
