"""Real Hugging Face ``config.json`` files (``tests/data/hf_configs``, sources in its SOURCES.md).

Each accepted config has a hand-computed bytes per token for each token pool of its plan, at
bfloat16 (or the config's own dtype under ``kv_cache_dtype="auto"``), tensor parallel 1, planned
for TPU, where head dims are padded to a multiple of 128 (64 -> 128, 96 -> 128, MLA 576 -> 640).
Recurrent states are checked per request and layer. Every config and preset must also keep its
device bytes within the budget at tp 1, 2, 4 and 8, or be refused naming the tp size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvjax import CacheConfig, ConfigError, LayerKind, ModelSpec, plan_kv_cache

CORPUS = Path(__file__).parent / "data" / "hf_configs"
GIB = 2**30

# name: {pool name: bytes per token}, written as layers x 2 (K and V) x kv heads x padded head dim x bytes.
EXPECTED_BYTES_PER_TOKEN: dict[str, dict[str, int]] = {
    "llama-2-7b-hf": {"kv": 32 * 2 * 32 * 128 * 4},  # torch_dtype float32: 4 bytes
    "llama-2-70b-chat-hf": {"kv": 80 * 2 * 8 * 128 * 4},  # float32 too
    "llama-3-8b": {"kv": 32 * 2 * 8 * 128 * 2},
    "llama-3-70b": {"kv": 80 * 2 * 8 * 128 * 2},
    "mistral-7b": {"kv": 32 * 2 * 8 * 128 * 2},
    "mixtral-8x7b-instruct-v0.1": {"kv": 32 * 2 * 8 * 128 * 2},
    "qwen2.5-7b": {"kv": 28 * 2 * 4 * 128 * 2},
    "qwen2.5-1.5b-instruct": {"kv": 28 * 2 * 2 * 128 * 2},
    "qwen3-14b": {"kv": 40 * 2 * 8 * 128 * 2},
    "qwen1.5-moe-a2.7b-chat": {"kv": 24 * 2 * 16 * 128 * 2},  # hidden 2048 / 16 heads = 128
    "qwen3-30b-a3b": {"kv": 48 * 2 * 4 * 128 * 2},
    "qwen3-coder-30b-a3b-instruct": {"kv": 48 * 2 * 4 * 128 * 2},
    "phi-3-mini-4k-instruct": {"kv": 32 * 2 * 32 * 128 * 2},  # head_dim 3072 / 32 = 96, padded to 128
    "phi-4-mini-instruct": {"kv": 32 * 2 * 8 * 128 * 2},  # window 262,144 >= context 131,072: full
    "olmo-2-1124-7b": {"kv": 32 * 2 * 32 * 128 * 2},
    "glm-4.5-air": {"kv": 46 * 2 * 8 * 128 * 2},
    "olmoe-1b-7b-0125-instruct": {"kv": 16 * 2 * 16 * 128 * 2},  # unknown model_type, standard keys
    "granite-3.1-3b-a800m-instruct": {"kv": 32 * 2 * 8 * 128 * 2},  # head_dim 1536 / 24 = 64 -> 128
    "gemma-2-9b": {"kv_full": 21 * 2 * 8 * 256 * 2, "kv_swa": 21 * 2 * 8 * 256 * 2},
    "gemma-3-12b": {"kv_full": 8 * 2 * 8 * 256 * 2, "kv_swa": 40 * 2 * 8 * 256 * 2},
    "gpt-oss-20b": {"kv_full": 12 * 2 * 8 * 128 * 2, "kv_swa": 12 * 2 * 8 * 128 * 2},  # head_dim 64 -> 128
    "gpt-oss-20b-transformers5": {"kv_full": 12 * 2 * 8 * 128 * 2, "kv_swa": 12 * 2 * 8 * 128 * 2},
    "deepseek-v2-lite-chat": {"kv": 27 * 640 * 2},  # kv_lora_rank 512 + rope 64 = 576 -> 640
    "deepseek-v3": {"kv": 61 * 640 * 2},
    # DSA adds the indexer's keys: index_head_dim 128 uint8 + 128 / 128 x 4 scale bytes per layer.
    "deepseek-v3.2": {"kv": 61 * 640 * 2, "index_k": 61 * (128 + 4)},
    "deepseek-moe-16b": {"kv": 28 * 2 * 16 * 128 * 2},  # model_type deepseek: plain MHA, 2048 / 16 = 128
    "qwen3-next-80b-a3b": {"kv": 12 * 2 * 2 * 256 * 2},  # the 12 full-attention layers only
    "falcon-h1-7b-instruct": {"kv": 44 * 2 * 2 * 128 * 2},  # every layer attends
    "nemotron-3-nano-30b-a3b": {"kv": 6 * 2 * 2 * 128 * 2},  # the six '*' layers
    "nemotron-3-super-120b-a12b": {"kv": 8 * 2 * 2 * 128 * 2},
    "nemotron-h-8b-base-8k": {"kv": 4 * 2 * 8 * 128 * 2},  # four '*' layers; attention_head_dim 128
    "minimax-m1": {"kv": 10 * 2 * 8 * 128 * 2},  # the ten softmax layers
}

# name: (recurrent layers, bytes of one request's state in one layer, mixer), unsharded.
EXPECTED_RECURRENT = {
    # conv (2*16*128 + 32*128 = 8192 channels x 3) bf16 + ssm 32 x 128 x 128 f32
    "qwen3-next-80b-a3b": (36, 8192 * 3 * 2 + 32 * 128 * 128 * 4, "gated_delta_net"),
    # conv (3072 + 2*1*256 = 3584 x 3) bf16 + ssm 24 heads x 128 x 256 f32, in all 44 layers
    "falcon-h1-7b-instruct": (44, 3584 * 3 * 2 + 24 * 128 * 256 * 4, "mamba2"),
    # conv (64*64 + 2*8*128 = 6144 x 3) bf16 + ssm 64 x 64 x 128 f32, the 23 'M' layers
    "nemotron-3-nano-30b-a3b": (23, 6144 * 3 * 2 + 64 * 64 * 128 * 4, "mamba2"),
    # conv (128*64 + 2*8*128 = 10240 x 3) bf16 + ssm 128 x 64 x 128 f32, the 40 'M' layers
    "nemotron-3-super-120b-a12b": (40, 10240 * 3 * 2 + 128 * 64 * 128 * 4, "mamba2"),
    # conv (128*64 + 2*8*128 = 10240 x 3) bf16 + ssm 128 x 64 x 128 f32, the 24 'M' layers
    "nemotron-h-8b-base-8k": (24, 10240 * 3 * 2 + 128 * 64 * 128 * 4, "mamba2"),
    # lightning attention: one 128 x 128 f32 matrix per head, 64 heads, in the 70 linear layers
    "minimax-m1": (70, 64 * 128 * 128 * 4, "lightning"),
}

# name: words the refusal must contain (the option and the reason).
REFUSED = {
    "gpt2": ("model_type", "gpt2", "num_hidden_layers", "num_attention_heads"),
    "deepseek-v3.2-exp-no-indexer-keys": ("max_position_embeddings", "deepseek_v32"),
    # An unknown hybrid: its Mamba keys say the standard attention keys do not describe it.
    "jamba-v0.1": ("model_type", "jamba", "mamba_d_state"),
}

WARNED = {
    "olmoe-1b-7b-0125-instruct": "olmoe",
    "granite-3.1-3b-a800m-instruct": "granitemoe",
}


def corpus_names() -> list[str]:
    return sorted(p.stem for p in CORPUS.glob("*.json"))


def load(name: str) -> ModelSpec:
    return ModelSpec.from_json_file(CORPUS / f"{name}.json")


def plan(spec: ModelSpec, tp: int = 1):
    return plan_kv_cache(spec, CacheConfig(memory_budget_bytes=16 * GIB, page_size=16, tp_size=tp))


def test_the_corpus_is_large_and_fully_covered():
    names = set(corpus_names())
    assert len(names) >= 25
    assert names == set(EXPECTED_BYTES_PER_TOKEN) | set(REFUSED)
    assert (CORPUS / "SOURCES.md").read_text().count(".json") >= len(names)


@pytest.mark.parametrize("name", sorted(EXPECTED_BYTES_PER_TOKEN))
def test_bytes_per_token_per_pool(name):
    p = plan(load(name))
    token_pools = {q.name: q.bytes_per_token for q in p.pools if q.memory == "device" and q.bytes_per_token}
    assert token_pools == EXPECTED_BYTES_PER_TOKEN[name]
    assert p.max_total_tokens > 0


@pytest.mark.parametrize("name", sorted(EXPECTED_RECURRENT))
def test_recurrent_state_per_request(name):
    spec = load(name)
    layers, per_layer, mixer = EXPECTED_RECURRENT[name]
    assert len(spec.recurrent_layer_ids()) == layers
    assert spec.recurrent is not None
    assert spec.recurrent.bytes_per_slot() == per_layer
    assert spec.recurrent.mixer == mixer


def test_hybrid_layer_kinds():
    falcon = load("falcon-h1-7b-instruct")
    assert set(falcon.layer_kinds) == {LayerKind.FULL_AND_RECURRENT}
    assert falcon.attention_layer_ids(LayerKind.FULL) == falcon.recurrent_layer_ids() == tuple(range(44))
    dense = load("nemotron-h-8b-base-8k")
    # M-M-M-M*-...: attention at 7, 18, 29, 40; the 24 '-' MLP layers cache nothing.
    assert dense.attention_layer_ids(LayerKind.FULL) == (7, 18, 29, 40) and dense.count(LayerKind.NONE) == 24
    assert dense.head_dim == 128
    v32 = load("deepseek-v3.2")
    assert v32.is_dsa and v32.index_head_dim == 128 and v32.attention_layer_ids(LayerKind.MLA) == tuple(range(61))
    nano = load("nemotron-3-nano-30b-a3b")
    # MEMEM*EMEMEM*...: attention at 5, 12, 19, 26, 33, 42; the MoE ('E') layers cache nothing.
    assert nano.attention_layer_ids(LayerKind.FULL) == (5, 12, 19, 26, 33, 42)
    assert nano.count(LayerKind.NONE) == 23 and nano.num_kv_layers == 6
    minimax = load("minimax-m1")
    assert minimax.attention_layer_ids(LayerKind.FULL) == tuple(range(7, 80, 8))
    assert minimax.uses_linear_attention
    oss = load("gpt-oss-20b")
    assert oss.attention_sinks and oss.sliding_window == 128
    assert oss.attention_layer_ids(LayerKind.SLIDING) == tuple(range(0, 24, 2))


def test_transformers_5_config_reads_like_the_4_x_one():
    old, new = load("gpt-oss-20b"), load("gpt-oss-20b-transformers5")
    assert (new.rope_theta, new.dtype) == (old.rope_theta, old.dtype) == (150000.0, "bfloat16")
    assert new.layer_kinds == old.layer_kinds


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_configs_name_the_missing_keys(name):
    with pytest.raises(ConfigError) as info:
        load(name)
    for word in REFUSED[name]:
        assert word in str(info.value)


@pytest.mark.parametrize("name", sorted(WARNED))
def test_unknown_families_plan_with_a_warning(name):
    spec = load(name)
    assert any(WARNED[name] in w and "not a family kvjax knows" in w for w in spec.warnings)
    assert any(WARNED[name] in w for w in plan(spec).warnings)


def _all_specs() -> list[tuple[str, ModelSpec]]:
    specs = [(f"preset:{n}", ModelSpec.preset(n)) for n in ModelSpec.presets()]
    return specs + [(n, load(n)) for n in sorted(EXPECTED_BYTES_PER_TOKEN)]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_device_bytes_never_exceed_the_budget(tp):
    over = []
    for name, spec in _all_specs():
        try:
            p = plan(spec, tp)
        except ConfigError as e:
            # Refused, naming the tensor-parallel size (heads that do not split evenly).
            assert "tp" in e.option or "tp" in str(e), f"{name} tp={tp}: {e}"
            continue
        if p.device_bytes > p.kv_budget_bytes:
            over.append((name, p.device_bytes, p.kv_budget_bytes))
    assert over == []
