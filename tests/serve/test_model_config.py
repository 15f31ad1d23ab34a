"""The serving model's shape from real Hugging Face configs: every servable family in the config
corpus builds the architecture with exactly the published parameter count (nothing allocated:
``param_shapes`` is ``jax.eval_shape``), and what kvjax cannot serve is refused by name.

Layers are identical, so the count is measured on 1- and 2-layer copies of each config and
extended linearly to the real depth (tracing 80 layers would take seconds per model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import pytest

from kvjax import ModelSpec
from kvjax.errors import ConfigError
from kvjax.serve.families.llama import LlamaWindows
from kvjax.serve.model import param_shapes
from kvjax.serve.model_config import model_config_from_spec

CONFIGS = Path(__file__).resolve().parent.parent / "data" / "hf_configs"

# Parameter counts as published on the models' Hugging Face pages (safetensors metadata).
PUBLISHED_PARAMETERS = {
    "llama-2-7b-hf": ("llama", 6_738_415_616),
    "llama-2-70b-chat-hf": ("llama", 68_976_648_192),
    "llama-3-8b": ("llama", 8_030_261_248),
    "llama-3-70b": ("llama", 70_553_706_496),
    "mistral-7b": ("mistral", 7_248_023_552),  # v0.3 (32,768-token vocabulary)
    "qwen2.5-1.5b-instruct": ("qwen2", 1_543_714_304),  # tied head
    "qwen2.5-7b": ("qwen2", 7_615_616_512),
    "qwen3-14b": ("qwen3", 14_768_307_200),
}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_real_configs_build_the_published_parameter_count(name):
    family, published = PUBLISHED_PARAMETERS[name]
    config = model_config_from_spec(ModelSpec.from_hf_config(_config(name)))
    assert config.family == family

    def count(layers: int) -> int:
        shapes = param_shapes(config.replace(num_hidden_layers=layers))
        return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))

    one, two = count(1), count(2)
    assert one + (config.num_hidden_layers - 1) * (two - one) == published


def test_qwen2_has_qkv_biases_and_qwen3_has_qk_norms():
    def one_layer(name: str) -> dict:
        config = model_config_from_spec(ModelSpec.from_hf_config(_config(name)))
        return param_shapes(config.replace(num_hidden_layers=1))

    qwen2 = one_layer("qwen2.5-7b")
    attn = qwen2["model"]["layers_0"]["self_attn"]
    assert {"bias"} <= set(attn["q_proj"]) and "bias" not in attn["o_proj"]
    qwen3 = one_layer("qwen3-14b")
    attn = qwen3["model"]["layers_0"]["self_attn"]
    assert attn["q_norm"]["weight"].shape == attn["k_norm"]["weight"].shape == (128,)


def test_families_and_layers_kvjax_cannot_serve_are_refused_by_name():
    with pytest.raises(ConfigError, match="model_type='gemma2'"):
        model_config_from_spec(ModelSpec.from_hf_config(_config("gemma-2-9b")))
    windowed = {
        **_config("qwen2.5-7b"),
        "model_type": "qwen3",
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 0,
    }
    with pytest.raises(ConfigError, match="sliding_window=4096"):
        model_config_from_spec(ModelSpec.from_hf_config(windowed))
    # Mistral with a window slides on every layer: served (a pure sliding-window model).
    mistral = model_config_from_spec(ModelSpec.from_hf_config({**_config("mistral-7b"), "sliding_window": 4096}))
    assert mistral.family_config == LlamaWindows((True,) * 32, 4096)
    gelu = {**_config("llama-3-8b"), "hidden_act": "gelu"}
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        model_config_from_spec(ModelSpec.from_hf_config(gelu))


def test_yarn_matches_transformers_and_is_refused_where_the_family_does_not_scale():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvjax.serve.model_config import read_rope

    cases = [
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
        dict(factor=4.0, original_max_position_embeddings=64),
        dict(factor=8.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0),
    ]
    for extra in cases:
        params = {"rope_type": "yarn", "rope_theta": 150000.0, **extra}
        hf = transformers.GptOssConfig(
            hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256, rope_parameters=params
        )
        inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf)
        rope = read_rope(hf.to_dict(), yarn=True)
        np = pytest.importorskip("numpy")
        np.testing.assert_allclose(rope.inverse_frequencies(16), inv_freq.numpy(), rtol=1e-6, atol=0)
        assert math.isclose(rope.attention_scaling(), scaling, rel_tol=1e-12)
        with pytest.raises(ConfigError, match="yarn"):
            read_rope(hf.to_dict())


def _tiny_gpt_oss(**changes):
    config = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 256,
        "attention_bias": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "truncate": False},
    }
    return {**config, **changes}


def test_gpt_oss_reads_yarn_experts_and_sinks_and_refuses_bad_expert_counts_by_name():
    config = model_config_from_spec(ModelSpec.from_hf_config(_tiny_gpt_oss()))
    assert config.rope.rope_type == "yarn" and config.rope.attention_scaling() > 1.0
    assert config.family_config.sliding == (True, False) and config.family_config.top_k == 2
    attn = param_shapes(config)["model"]["layers_0"]["self_attn"]
    assert attn["sinks"].shape == (4,) and attn["o_proj"]["bias"].shape == (64,)
    experts = param_shapes(config)["model"]["layers_1"]["mlp"]["experts"]
    assert experts["gate_up_proj"].shape == (4, 64, 64) and experts["down_proj"].shape == (4, 32, 64)
    with pytest.raises(ConfigError, match="num_experts_per_tok=8"):
        model_config_from_spec(ModelSpec.from_hf_config(_tiny_gpt_oss(num_experts_per_tok=8)))
    with pytest.raises(ConfigError, match="num_local_experts=0"):
        model_config_from_spec(ModelSpec.from_hf_config(_tiny_gpt_oss(num_local_experts=0)))
    mxfp4 = _tiny_gpt_oss(quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ConfigError, match="quant_method='mxfp4'"):
        model_config_from_spec(ModelSpec.from_hf_config(mxfp4))
    yarn_llama = {**_config("llama-3-8b"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        model_config_from_spec(ModelSpec.from_hf_config(yarn_llama))
