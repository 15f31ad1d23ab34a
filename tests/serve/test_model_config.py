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
    windowed = {**_config("mistral-7b"), "sliding_window": 4096}
    with pytest.raises(ConfigError, match="sliding_window=4096"):
        model_config_from_spec(ModelSpec.from_hf_config(windowed))
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
