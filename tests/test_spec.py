"""`ModelSpec`: Hugging Face config parsing, shipped presets and the spec's own validation.

Expected numbers are written out by hand from the models' published configs, not computed
with the parser's formulas.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

import kvjax
from kvjax import ConfigError, LayerKind, ModelSpec
from kvjax.hf_config import parse_hf_config, supported_model_types

FULL, SLIDING, MLA, RECURRENT = LayerKind.FULL, LayerKind.SLIDING, LayerKind.MLA, LayerKind.RECURRENT

PRESETS = (
    "deepseek-tiny",
    "deepseek-v3",
    "gemma-2-9b",
    "gemma-3-12b",
    "gemma3-tiny",
    "llama-3-70b",
    "llama-3-8b",
    "mistral-7b",
    "mistral-swa-tiny",
    "qwen2.5-7b",
    "qwen3-next-80b-a3b",
    "tiny",
)

# name: (layers, {kind: count}, attention heads, kv heads, head_dim, v_head_dim, window, context, vocab, dtype)
EXPECTED = {
    "llama-3-8b": (32, {FULL: 32}, 32, 8, 128, 128, None, 8192, 128256, "bfloat16"),
    "llama-3-70b": (80, {FULL: 80}, 64, 8, 128, 128, None, 8192, 128256, "bfloat16"),
    "qwen2.5-7b": (28, {FULL: 28}, 28, 4, 128, 128, None, 131072, 152064, "bfloat16"),
    "mistral-7b": (32, {FULL: 32}, 32, 8, 128, 128, None, 32768, 32768, "bfloat16"),
    "gemma-2-9b": (42, {SLIDING: 21, FULL: 21}, 16, 8, 256, 256, 4096, 8192, 256000, "bfloat16"),
    "gemma-3-12b": (48, {SLIDING: 40, FULL: 8}, 16, 8, 256, 256, 1024, 131072, 262208, "bfloat16"),
    "deepseek-v3": (61, {MLA: 61}, 128, 1, 192, 128, None, 163840, 129280, "bfloat16"),
    "qwen3-next-80b-a3b": (48, {FULL: 12, RECURRENT: 36}, 16, 2, 256, 256, None, 262144, 151936, "bfloat16"),
    "tiny": (2, {FULL: 2}, 4, 2, 16, 16, None, 2048, 256, "float32"),
    "deepseek-tiny": (2, {MLA: 2}, 4, 1, 24, 16, None, 2048, 256, "float32"),
    "gemma3-tiny": (4, {SLIDING: 3, FULL: 1}, 4, 2, 16, 16, 16, 2048, 256, "float32"),
    "mistral-swa-tiny": (2, {SLIDING: 2}, 4, 2, 16, 16, 16, 2048, 256, "float32"),
}


def raw_preset(name: str) -> dict:
    """A preset's config.json as a fresh dict, for tests that edit it."""
    return copy.deepcopy(dict(ModelSpec.preset(name).extra))


def assert_config_error(option: str, fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert info.value.option == option, str(info.value)
    assert option in str(info.value)
    assert isinstance(info.value, ValueError)
    return info.value


# --- presets ------------------------------------------------------------------------------------


def test_presets_lists_every_shipped_config():
    assert ModelSpec.presets() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_shape(name):
    layers, counts, heads, kv_heads, head_dim, v_head_dim, window, context, vocab, dtype = EXPECTED[name]
    spec = ModelSpec.preset(name)
    assert spec.name == name
    assert spec.num_hidden_layers == layers == len(spec.layer_kinds)
    assert {k: spec.count(k) for k in LayerKind if spec.count(k)} == counts
    assert spec.num_attention_heads == heads
    assert spec.num_kv_heads == kv_heads
    assert spec.head_dim == head_dim
    assert spec.v_head_dim == v_head_dim
    assert spec.sliding_window == window
    assert spec.context_length == context
    assert spec.vocab_size == vocab
    assert spec.dtype == dtype
    json.dumps(spec.to_dict())


def test_llama_3_8b_details():
    spec = ModelSpec.preset("llama-3-8b")
    assert spec.model_type == "llama"
    assert spec.architectures == ("LlamaForCausalLM",)
    assert spec.hidden_size == 4096
    assert spec.intermediate_size == 14336
    assert spec.rope_theta == 500000.0
    assert not (spec.is_mla or spec.has_sliding_layers or spec.uses_ssm_state or spec.is_multimodal)
    assert spec.num_kv_layers == 32


def test_tiny_is_a_small_float32_llama():
    spec = ModelSpec.preset("tiny")
    assert (spec.model_type, spec.hidden_size, spec.intermediate_size) == ("llama", 64, 128)
    assert spec.dtype == "float32"


def test_gemma_2_alternates_starting_with_sliding():
    spec = ModelSpec.preset("gemma-2-9b")
    assert spec.layer_kinds[:4] == (SLIDING, FULL, SLIDING, FULL)
    assert spec.layer_ids(FULL) == tuple(range(1, 42, 2))
    assert spec.attn_logit_softcapping == 50.0
    assert not spec.is_multimodal


def test_gemma_3_every_sixth_layer_is_full():
    spec = ModelSpec.preset("gemma-3-12b")
    assert spec.layer_ids(FULL) == (5, 11, 17, 23, 29, 35, 41, 47)
    assert spec.is_multimodal
    assert spec.model_type == "gemma3"
    assert spec.architectures == ("Gemma3ForConditionalGeneration",)
    assert spec.hidden_size == 3840
    assert spec.rope_theta == 1_000_000.0
    assert spec.attn_logit_softcapping is None


def test_deepseek_v3_is_mla():
    spec = ModelSpec.preset("deepseek-v3")
    assert spec.is_mla and spec.layer_ids(MLA) == tuple(range(61))
    assert spec.kv_lora_rank == 512
    assert spec.qk_rope_head_dim == 64
    assert spec.num_nextn_predict_layers == 1
    assert not spec.is_dsa and spec.index_head_dim is None
    assert spec.num_kv_layers == 61


def test_qwen3_next_hybrid_layers_and_state():
    spec = ModelSpec.preset("qwen3-next-80b-a3b")
    assert spec.uses_ssm_state
    assert spec.layer_ids(FULL) == tuple(range(3, 48, 4))
    assert spec.num_kv_layers == 12
    state = spec.recurrent
    # conv_dim = 2 * 16 key heads * 128 + 32 value heads * 128 = 8192; kernel 4 keeps 3 inputs.
    assert state.conv_state_shapes == ((8192, 3),)
    assert state.conv_dtype == "bfloat16"
    assert state.ssm_state_shape == (32, 128, 128)
    assert state.ssm_dtype == "float32"
    # 8192 * 3 * 2 bytes + 32 * 128 * 128 * 4 bytes = 49,152 + 2,097,152
    assert state.bytes_per_slot() == 2_146_304


def test_specs_are_hashable_and_equal_when_parsed_twice():
    for name in PRESETS:
        a, b = ModelSpec.preset(name), ModelSpec.preset(name)
        assert a == b and hash(a) == hash(b)
        assert a is not b
    assert len({ModelSpec.preset(n) for n in PRESETS for _ in range(2)}) == len(PRESETS)
    assert ModelSpec.preset("tiny") != ModelSpec.from_hf_config(raw_preset("tiny"), name="other")


def test_extra_keeps_a_copy_of_the_raw_config():
    config = raw_preset("llama-3-8b")
    spec = ModelSpec.from_hf_config(config)
    config["num_hidden_layers"] = 1
    assert spec.extra["num_hidden_layers"] == 32
    assert spec.extra["rms_norm_eps"] == 1e-05


def test_unknown_preset_is_a_config_error():
    err = assert_config_error("model", ModelSpec.preset, "llama-9")
    assert "llama-3-8b" in str(err)


# --- resolve and files --------------------------------------------------------------------------


def test_resolve_a_config_json_path(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(raw_preset("mistral-7b")))
    spec = ModelSpec.resolve(str(path))
    assert spec.name == "my-model"
    assert spec == dataclasses.replace(ModelSpec.preset("mistral-7b"), name="my-model")


def test_resolve_a_preset_name_and_a_missing_path(tmp_path):
    assert ModelSpec.resolve("tiny") == ModelSpec.preset("tiny")
    assert_config_error("model", ModelSpec.resolve, str(tmp_path / "absent.json"))


def test_unreadable_config_file_is_a_config_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert_config_error("model", ModelSpec.from_json_file, path)


# --- family rules -------------------------------------------------------------------------------


def test_qwen2_sliding_window_only_when_enabled():
    config = raw_preset("qwen2.5-7b")
    assert config["sliding_window"] == 131072 and config["use_sliding_window"] is False
    config.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    spec = parse_hf_config(config, name="q")
    assert spec.layer_ids(SLIDING) == tuple(range(20, 28))
    assert spec.count(FULL) == 20
    assert spec.sliding_window == 4096


def test_qwen2_enabled_window_past_the_last_layer_slides_nothing():
    config = raw_preset("qwen2.5-7b")
    config.update(use_sliding_window=True, max_window_layers=28)
    spec = parse_hf_config(config)
    assert spec.count(FULL) == 28 and spec.sliding_window is None


def test_qwen2_explicit_layer_types_win():
    config = raw_preset("qwen2.5-7b")
    config["layer_types"] = ["sliding_attention"] * 2 + ["full_attention"] * 26
    config["use_sliding_window"] = True
    spec = parse_hf_config(config)
    assert spec.layer_ids(SLIDING) == (0, 1) and spec.sliding_window == 131072


def test_mistral_with_a_window_slides_everywhere():
    config = raw_preset("mistral-7b")
    config["sliding_window"] = 4096
    spec = parse_hf_config(config)
    assert spec.count(SLIDING) == 32 and spec.sliding_window == 4096


def test_gemma3_text_only_and_explicit_layer_types():
    text = dict(raw_preset("gemma-3-12b")["text_config"])
    text["architectures"] = ["Gemma3ForCausalLM"]
    spec = parse_hf_config(text, name="gemma3-text")
    assert spec.model_type == "gemma3_text" and not spec.is_multimodal
    assert spec.layer_ids(FULL) == (5, 11, 17, 23, 29, 35, 41, 47)
    text["layer_types"] = ["sliding_attention", "full_attention"] * 24
    text["sliding_window_pattern"] = 6
    assert parse_hf_config(text).layer_ids(FULL) == tuple(range(1, 48, 2))


def test_gemma3_private_sliding_window_pattern_key():
    text = {**raw_preset("gemma-3-12b")["text_config"], "_sliding_window_pattern": 4}
    assert parse_hf_config(text).layer_ids(FULL) == tuple(range(3, 48, 4))


def test_gemma3_missing_text_key_names_text_config():
    config = raw_preset("gemma-3-12b")
    config["text_config"]["num_hidden_layers"] = "48"
    err = assert_config_error("num_hidden_layers", parse_hf_config, config)
    assert "gemma3 text_config" in str(err)


def test_gemma3_sliding_window_pattern_and_defaults():
    spec = parse_hf_config({"model_type": "gemma3_text", "sliding_window_pattern": 2})
    # Hugging Face's Gemma3TextConfig defaults: 26 layers, 4 KV heads, head_dim 256, window 4096.
    assert spec.num_hidden_layers == 26 and spec.count(FULL) == 13
    assert (spec.num_kv_heads, spec.head_dim, spec.sliding_window) == (4, 256, 4096)
    assert parse_hf_config({"model_type": "gemma3"}).is_multimodal


def test_deepseek_v32_is_dsa():
    config = raw_preset("deepseek-v3")
    config.update(model_type="deepseek_v32", index_head_dim=128, index_n_heads=64, index_topk=2048)
    spec = parse_hf_config(config)
    assert spec.is_dsa and spec.index_head_dim == 128 and spec.is_mla
    del config["index_head_dim"]
    assert_config_error("index_head_dim", parse_hf_config, config)


def test_deepseek_v2_and_explicit_head_dim():
    config = raw_preset("deepseek-v3")
    config.update(model_type="deepseek_v2", head_dim=64, num_nextn_predict_layers=None)
    spec = parse_hf_config(config)
    assert (spec.head_dim, spec.v_head_dim, spec.num_kv_heads) == (192, 128, 1)
    assert spec.num_nextn_predict_layers == 0


def test_qwen3_next_layer_types_and_ssm_dtype():
    config = raw_preset("qwen3-next-80b-a3b")
    config["layer_types"] = ["linear_attention", "full_attention"] * 24
    config["mamba_ssm_dtype"] = "bfloat16"
    spec = parse_hf_config(config)
    assert spec.layer_ids(FULL) == tuple(range(1, 48, 2))
    assert spec.recurrent.ssm_dtype == "bfloat16"
    assert spec.recurrent.bytes_per_slot() == 8192 * 3 * 2 + 32 * 128 * 128 * 2


def test_recurrent_state_with_unequal_head_dims():
    config = raw_preset("qwen3-next-80b-a3b")
    config.update(
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=3,
    )
    state = parse_hf_config(config).recurrent
    assert state.conv_state_shapes == ((2 * 4 * 32 + 8 * 64, 2),)
    assert (state.conv_dtype, state.ssm_state_shape, state.ssm_dtype) == ("bfloat16", (8, 64, 32), "float32")
    assert (state.mixer, state.num_heads, state.n_groups, state.state_size) == ("gated_delta_net", 8, 4, 32)


def test_dispatch_by_architecture_when_model_type_is_absent():
    config = raw_preset("llama-3-8b")
    del config["model_type"]
    assert parse_hf_config(config).count(FULL) == 32


def test_defaults_for_head_dim_kv_heads_dtype_and_rope():
    config = raw_preset("tiny")
    for key in ("head_dim", "num_key_value_heads", "torch_dtype", "rope_theta"):
        del config[key]
    spec = parse_hf_config(config)
    assert (spec.head_dim, spec.num_kv_heads, spec.dtype, spec.rope_theta) == (16, 4, "bfloat16", 10000.0)


@pytest.mark.parametrize(
    "entry, dtype",
    [
        ({"torch_dtype": "float16"}, "float16"),
        ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
        ({"dtype": "float32", "torch_dtype": "float16"}, "float32"),
        ({"torch_dtype": "auto"}, "bfloat16"),
    ],
)
def test_dtype_mapping(entry, dtype):
    config = {**raw_preset("tiny"), **entry}
    assert parse_hf_config(config).dtype == dtype


def test_rope_theta_under_rope_parameters():
    config = raw_preset("tiny")
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 250000.0}
    assert parse_hf_config(config).rope_theta == 250000.0


def test_bad_rope_theta_is_a_config_error():
    config = {**raw_preset("tiny"), "rope_theta": "fast"}
    assert_config_error("rope_theta", parse_hf_config, config)


def test_name_falls_back_to_name_or_path_then_model_type():
    config = raw_preset("tiny")
    assert parse_hf_config(config).name == "llama"
    config["_name_or_path"] = "org/tiny"
    assert parse_hf_config(config).name == "org/tiny"
    assert parse_hf_config(config, name="x").name == "x"


# --- parse errors -------------------------------------------------------------------------------


def test_unknown_model_type_is_named():
    err = assert_config_error("model_type", parse_hf_config, {"model_type": "gpt2", "n_layer": 12})
    assert "gpt2" in str(err)
    for family in ("llama", "qwen3_next", "deepseek_v3", "gemma3"):
        assert family in str(err) and family in supported_model_types()


@pytest.mark.parametrize("model_type", ["jamba", "bamba"])
def test_unknown_hybrids_are_refused_not_planned_as_attention(model_type):
    config = {**raw_preset("tiny"), "model_type": model_type, "mamba_d_state": 16, "attn_layer_period": 8}
    err = assert_config_error("model_type", ModelSpec.from_hf_config, config)
    assert model_type in str(err) and "mamba_d_state" in str(err)


def test_no_model_type_and_no_known_architecture():
    assert_config_error("model_type", parse_hf_config, {"architectures": ["MysteryForCausalLM"]})


@pytest.mark.parametrize(
    "preset, key",
    [
        ("llama-3-8b", "num_hidden_layers"),
        ("llama-3-8b", "max_position_embeddings"),
        ("mistral-7b", "vocab_size"),
        ("deepseek-v3", "kv_lora_rank"),
        ("deepseek-v3", "qk_rope_head_dim"),
        ("qwen3-next-80b-a3b", "linear_num_key_heads"),
        ("qwen3-next-80b-a3b", "linear_conv_kernel_dim"),
    ],
)
def test_missing_required_key_is_named(preset, key):
    config = raw_preset(preset)
    del config[key]
    err = assert_config_error(key, parse_hf_config, config)
    assert "config.json" in str(err)


@pytest.mark.parametrize("value", ["32", 0, -1, 2.5, True])
def test_malformed_integer_is_named(value):
    config = raw_preset("tiny")
    config["num_hidden_layers"] = value
    assert_config_error("num_hidden_layers", parse_hf_config, config)


def test_integral_float_is_accepted():
    config = raw_preset("tiny")
    config["max_position_embeddings"] = 2048.0
    assert parse_hf_config(config).context_length == 2048


def test_bad_layer_types_are_named():
    config = raw_preset("gemma-2-9b")
    config["layer_types"] = ["sliding_attention"] * 41
    assert_config_error("layer_types", parse_hf_config, config)
    config["layer_types"] = ["chunked_attention"] * 42
    assert_config_error("layer_types", parse_hf_config, config)


def test_bad_dtype_and_non_mapping_config():
    config = raw_preset("tiny")
    config["torch_dtype"] = "int8"
    assert_config_error("torch_dtype", parse_hf_config, config)
    assert_config_error("config", parse_hf_config, ["not", "a", "dict"])


def test_head_dim_needed_when_hidden_does_not_divide():
    config = raw_preset("tiny")
    del config["head_dim"]
    config["num_attention_heads"] = 5
    assert_config_error("head_dim", parse_hf_config, config)


# --- ModelSpec validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, changes, option",
    [
        ("tiny", {"layer_kinds": (FULL,)}, "layer_kinds"),
        ("tiny", {"num_hidden_layers": 0, "layer_kinds": ()}, "num_hidden_layers"),
        ("tiny", {"sliding_window": 128}, "sliding_window"),
        ("tiny", {"layer_kinds": (SLIDING, FULL)}, "sliding_window"),
        ("tiny", {"layer_kinds": (RECURRENT, FULL)}, "recurrent"),
        ("qwen3-next-80b-a3b", {"recurrent": None}, "recurrent"),
        ("tiny", {"layer_kinds": (MLA, MLA)}, "kv_lora_rank"),
        ("tiny", {"num_kv_heads": 0}, "num_kv_heads"),
        ("tiny", {"head_dim": 0}, "head_dim"),
        ("tiny", {"context_length": -1}, "context_length"),
        ("tiny", {"dtype": "int4"}, "dtype"),
    ],
)
def test_spec_validation_names_the_field(preset, changes, option):
    spec = ModelSpec.preset(preset)
    assert_config_error(option, dataclasses.replace, spec, **changes)


def test_layer_kinds_accept_strings():
    spec = dataclasses.replace(ModelSpec.preset("tiny"), layer_kinds=("full_attention", "full_attention"))
    assert spec == ModelSpec.preset("tiny")


def test_public_names():
    assert kvjax.ModelSpec is ModelSpec and kvjax.ConfigError is ConfigError


# --- recurrent state per tensor-parallel rank -----------------------------------------------------


def test_recurrent_state_per_rank_splits_heads_and_conv_channels():
    state = ModelSpec.preset("qwen3-next-80b-a3b").recurrent
    # 32 value heads and 8192 conv channels (16 key groups of 128, divisible by 4) over 4 ranks.
    rank = state.per_rank(4)
    assert rank.ssm_state_shape == (8, 128, 128) and rank.conv_state_shapes == ((2048, 3),)
    assert rank.bytes_per_slot() * 4 == state.bytes_per_slot()
    assert state.per_rank(1) is state
    assert_config_error("tp_size", state.per_rank, 64)  # 32 heads do not split over 64 ranks


def test_a_single_mamba2_group_is_replicated_to_every_rank():
    from kvjax.layer_kinds import mamba2_state

    # Falcon-H1-7B: width 3072, 1 group of state 256 -> conv 3072 + 2 * 256 = 3584 channels unsharded.
    state = mamba2_state(intermediate_size=3072, n_groups=1, num_heads=24, head_dim=128, state_size=256, conv_kernel=4)
    assert state.conv_state_shapes == ((3584, 3),)
    # Over 2 ranks the group is copied: (3072 + 2 * 2 * 256) / 2 = 2048 channels per rank.
    assert state.per_rank(2).conv_state_shapes == ((2048, 3),)
    assert state.per_rank(2).ssm_state_shape == (12, 128, 256)


def test_layer_kind_queries_for_hybrid_and_cache_free_layers():
    spec = dataclasses.replace(
        ModelSpec.preset("qwen3-next-80b-a3b"),
        num_hidden_layers=4,
        layer_kinds=(LayerKind.FULL_AND_RECURRENT, LayerKind.NONE, RECURRENT, FULL),
    )
    assert spec.attention_layer_ids(FULL) == (0, 3)
    assert spec.recurrent_layer_ids() == (0, 2)
    assert spec.num_kv_layers == 2 and spec.num_recurrent_layers == 2
    assert_config_error("kind", spec.attention_layer_ids, LayerKind.NONE)
    no_state = dataclasses.replace(spec, layer_kinds=(FULL, LayerKind.NONE, FULL, FULL), recurrent=None)
    assert no_state.recurrent_layer_ids() == () and not no_state.uses_ssm_state


def test_missing_kv_heads_is_mha_with_a_warning():
    config = raw_preset("llama-3-8b")
    del config["num_key_value_heads"]
    spec = parse_hf_config(config)
    assert spec.num_kv_heads == 32
    assert any("num_key_value_heads" in w and "multi-head" in w for w in spec.warnings)
    assert not ModelSpec.preset("llama-3-8b").warnings


def test_every_missing_key_is_named_at_once():
    config = raw_preset("llama-3-8b")
    del config["num_hidden_layers"], config["vocab_size"]
    err = assert_config_error("num_hidden_layers, vocab_size", parse_hf_config, config)
    assert "'num_hidden_layers', 'vocab_size'" in str(err)


def test_an_unknown_wrapper_says_its_decoder_is_under_text_config():
    config = {"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 64, "layer_types": ["linear_attention"]}}
    err = assert_config_error("model_type", parse_hf_config, config)
    assert "text_config" in str(err) and "num_hidden_layers" in str(err)
