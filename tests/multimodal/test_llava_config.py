"""LLaVA's config read for planning: the language model's cache from ``text_config`` (a config
Transformers writes, and an older checkpoint's partial ``text_config`` filled with Transformers'
defaults, each named in a warning), ``is_multimodal`` set; bad input refused by name."""

from __future__ import annotations

import json

import pytest

from kvjax import CacheConfig
from kvjax.errors import ConfigError
from kvjax.hf_config import parse_hf_config
from kvjax.plan import plan_kv_cache

transformers = pytest.importorskip("transformers")


def _tiny_llava_dict() -> dict:
    text = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=256,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    config = transformers.LlavaConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=299, dtype="float32"
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return json.loads(config.to_json_string())


def test_a_config_transformers_writes_plans_as_its_language_model():
    raw = _tiny_llava_dict()
    spec = parse_hf_config(raw)
    text = parse_hf_config({**raw["text_config"], "dtype": "float32"})  # the outer dtype, as the wrapper reads it
    assert spec.model_type == "llava" and spec.is_multimodal and not text.is_multimodal
    assert spec.layer_kinds == text.layer_kinds and spec.num_kv_heads == text.num_kv_heads == 2
    assert spec.warnings == () and spec.dtype == "float32"
    config = CacheConfig(max_total_tokens=64, context_length=64)
    assert plan_kv_cache(spec, config).bytes_per_token == plan_kv_cache(text, config).bytes_per_token


def test_an_older_checkpoints_partial_text_config_takes_transformers_defaults():
    """``llava-hf/llava-1.5-7b-hf``'s config as Transformers 4 saved it (its text_config keys)."""
    raw = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "torch_dtype": "float16",
        "image_token_index": 32000,
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": 32064,
        },
        "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
    }
    spec = parse_hf_config(raw)
    assert len(spec.layer_kinds) == 32 and spec.num_kv_heads == 32 and spec.context_length == 4096
    assert spec.dtype == "float16" and spec.is_multimodal
    filled = [w for w in spec.warnings if "read Transformers' llama default" in w]
    assert len(filled) == 3 and any("num_hidden_layers; read Transformers' llama default 32" in w for w in filled)


def test_a_mistral_language_model_reads_its_window_default():
    spec = parse_hf_config({"model_type": "llava", "text_config": {"model_type": "mistral"}})
    assert spec.num_kv_heads == 8 and spec.sliding_window == 4096


@pytest.mark.parametrize(
    ("text_config", "message"),
    [
        ("llama", "text_config='llama'"),
        ({"model_type": "gemma2"}, "text_config.model_type='gemma2'"),
    ],
)
def test_bad_text_config(text_config, message):
    with pytest.raises(ConfigError, match=message):
        parse_hf_config({"model_type": "llava", "text_config": text_config})
