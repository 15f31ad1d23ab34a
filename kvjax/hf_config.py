"""Parse a Hugging Face ``config.json`` dict into a `ModelSpec`.

One small parser per model family, picked by ``model_type`` (or, when that key is absent, by the
first known entry of ``architectures``). Each parser reads only the keys that decide what the model's
layers cache, and raises `ConfigError` naming the key when a required one is missing or unusable.

Families:
  * ``llama``: every layer FULL.
  * ``qwen2`` / ``qwen3``: FULL, unless ``use_sliding_window`` is true; then layers with index
    ``>= max_window_layers`` are SLIDING (Hugging Face's rule). An explicit ``layer_types`` wins.
  * ``mistral``: ``sliding_window`` null -> every layer FULL; set -> every layer SLIDING.
  * ``gemma2``: even layers SLIDING, odd layers FULL (or ``layer_types``); explicit ``head_dim``.
  * ``gemma3_text`` and the multimodal wrapper ``gemma3`` (``text_config``): ``layer_types``, else
    ``sliding_window_pattern`` N: every N-th layer FULL, the rest SLIDING. Missing text keys take
    Hugging Face's ``Gemma3TextConfig`` defaults, since its saved configs omit them.
  * ``deepseek_v2`` / ``deepseek_v3`` / ``deepseek_v32``: every layer MLA with one latent KV head;
    ``head_dim = qk_nope_head_dim + qk_rope_head_dim``; an indexer (``index_topk``) makes it DSA.
  * ``qwen3_next``: ``full_attention`` layers FULL, ``linear_attention`` layers RECURRENT (gated
    delta net) with SGLang's Mamba2-style state shapes.

Units: dims in elements, window and context lengths in tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from kvjax.errors import ConfigError
from kvjax.spec import LayerKind, ModelSpec, RecurrentStateSpec

_MISSING = object()

_DTYPE_NAMES = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
DEFAULT_DTYPE = "bfloat16"

# SGLang keeps the GDN / Mamba2 conv window in bfloat16 and the SSM state in float32 unless the
# config names ``mamba_ssm_dtype``.
RECURRENT_CONV_DTYPE = "bfloat16"
RECURRENT_SSM_DTYPE = "float32"

_LAYER_TYPE_KINDS = {
    "full_attention": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
}

# Hugging Face ``Gemma3TextConfig`` defaults for the keys the spec reads. Saved Gemma 3 configs
# write only the text keys that differ from these, so they must be filled in here.
_GEMMA3_TEXT_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rope_theta": 1_000_000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}


# --- small readers ------------------------------------------------------------------------------


def _where(family: str) -> str:
    """How messages name the config being read (``"llama config"``, ``"gemma3 text_config"``)."""
    return family if family.endswith("config") else f"{family} config"


def _get(config: Mapping[str, Any], key: str, family: str, default: Any = _MISSING) -> Any:
    """``config[key]``, or ``default``; a missing key without a default is a `ConfigError`."""
    value = config.get(key, None)
    if value is None:
        if default is _MISSING:
            raise ConfigError(key, None, f"a {_where(family)} needs '{key}'; add it to config.json")
        return default
    return value


def _int(config: Mapping[str, Any], key: str, family: str, default: Any = _MISSING, *, minimum: int = 1) -> Any:
    """An integer key (``>= minimum``); integral floats such as ``4096.0`` are accepted.

    Returns ``default`` unchecked when the key is absent or null (so ``default=None`` means optional).
    """
    if config.get(key) is None and default is not _MISSING:
        return default
    value = _get(config, key, family)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ConfigError(key, value, f"'{key}' in a {_where(family)} must be an integer")
    if value < minimum:
        raise ConfigError(key, value, f"'{key}' in a {_where(family)} must be >= {minimum}")
    return int(value)


def _float_or_none(value: Any, key: str, family: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, value, f"'{key}' in a {_where(family)} must be a number or null")
    return float(value)


def _dtype(config: Mapping[str, Any], fallback: str = DEFAULT_DTYPE) -> str:
    """The weights' dtype from ``dtype`` (newer Transformers) or ``torch_dtype``; absent -> ``fallback``."""
    key = "dtype" if config.get("dtype") is not None else "torch_dtype"
    raw = config.get(key)
    if raw is None or raw == "auto":
        return fallback
    name = str(raw).removeprefix("torch.").lower()
    if name not in _DTYPE_NAMES:
        raise ConfigError(key, raw, f"use one of {sorted(set(_DTYPE_NAMES.values()))} (or omit it for {fallback})")
    return _DTYPE_NAMES[name]


def _rope_theta(config: Mapping[str, Any], default: float) -> float:
    """``rope_theta``, or the one under ``rope_parameters`` (newer Transformers; per layer type for Gemma 3)."""
    if config.get("rope_theta") is not None:
        return _float_or_none(config["rope_theta"], "rope_theta", str(config.get("model_type")))
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        if isinstance(params.get("full_attention"), Mapping):
            params = params["full_attention"]
        if params.get("rope_theta") is not None:
            return _float_or_none(params["rope_theta"], "rope_parameters.rope_theta", str(config.get("model_type")))
    return float(default)


def _architectures(config: Mapping[str, Any]) -> tuple[str, ...]:
    archs = config.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    return tuple(str(a) for a in archs)


def _kinds_from_layer_types(
    config: Mapping[str, Any], num_layers: int, family: str, allowed: Mapping[str, LayerKind]
) -> tuple[LayerKind, ...] | None:
    """Kinds from an explicit ``layer_types`` list, or ``None`` when the config has none."""
    types = config.get("layer_types")
    if types is None:
        return None
    if isinstance(types, str) or not isinstance(types, (list, tuple)):
        raise ConfigError("layer_types", types, f"give a list of {sorted(allowed)} with one entry per layer")
    if len(types) != num_layers:
        fix = f"give exactly one entry per layer (num_hidden_layers={num_layers})"
        raise ConfigError("layer_types", f"{len(types)} entries", fix)
    unknown = sorted({str(t) for t in types} - set(allowed))
    if unknown:
        raise ConfigError("layer_types", unknown, f"a {_where(family)} supports layer types {sorted(allowed)}")
    return tuple(allowed[t] for t in types)


def _window_if_sliding(kinds: tuple[LayerKind, ...], window: int | None) -> int | None:
    """The spec carries a window only when some layer slides (a `ModelSpec` invariant)."""
    return window if LayerKind.SLIDING in kinds else None


def _attention_fields(
    config: Mapping[str, Any], family: str, *, head_dim_default: int | None = None, rope_theta_default: float = 10000.0
) -> dict[str, Any]:
    """Fields every attention family shares: layer count, heads, dims, vocab, context, dtype, rope."""
    layers = _int(config, "num_hidden_layers", family)
    heads = _int(config, "num_attention_heads", family)
    hidden = _int(config, "hidden_size", family)
    if head_dim_default is None:
        if hidden % heads:
            fix = f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}; set 'head_dim'"
            raise ConfigError("head_dim", None, fix)
        head_dim_default = hidden // heads
    head_dim = _int(config, "head_dim", family, head_dim_default)
    return {
        "architectures": _architectures(config),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_kv_heads": _int(config, "num_key_value_heads", family, heads),
        "head_dim": head_dim,
        "v_head_dim": head_dim,
        "hidden_size": hidden,
        "vocab_size": _int(config, "vocab_size", family),
        "context_length": _int(config, "max_position_embeddings", family),
        "dtype": _dtype(config),
        "rope_theta": _rope_theta(config, rope_theta_default),
        "intermediate_size": _int(config, "intermediate_size", family, 0, minimum=0),
    }


# --- families -----------------------------------------------------------------------------------


def _parse_llama(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    fields = _attention_fields(config, family)
    fields["layer_kinds"] = (LayerKind.FULL,) * fields["num_hidden_layers"]
    return fields


def _parse_qwen2(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    fields = _attention_fields(config, family)
    n = fields["num_hidden_layers"]
    # Qwen2 configs ship a window even when it is off; only use_sliding_window turns it on.
    window = _int(config, "sliding_window", family, None) if config.get("use_sliding_window") else None
    kinds = _kinds_from_layer_types(config, n, family, _LAYER_TYPE_KINDS)
    if kinds is None:
        first_sliding = _int(config, "max_window_layers", family, n, minimum=0) if window else n
        kinds = tuple(LayerKind.SLIDING if i >= first_sliding else LayerKind.FULL for i in range(n))
    elif LayerKind.SLIDING in kinds and window is None:
        window = _int(config, "sliding_window", family)
    fields["layer_kinds"] = kinds
    fields["sliding_window"] = _window_if_sliding(kinds, window)
    return fields


def _parse_mistral(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    fields = _attention_fields(config, family)
    n = fields["num_hidden_layers"]
    window = _int(config, "sliding_window", family, None)
    kind = LayerKind.SLIDING if window is not None else LayerKind.FULL
    fields["layer_kinds"] = (kind,) * n
    fields["sliding_window"] = window
    return fields


def _parse_gemma2(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    fields = _attention_fields(config, family, head_dim_default=256)
    n = fields["num_hidden_layers"]
    kinds = _kinds_from_layer_types(config, n, family, _LAYER_TYPE_KINDS)
    if kinds is None:
        kinds = tuple(LayerKind.SLIDING if i % 2 == 0 else LayerKind.FULL for i in range(n))
    fields["layer_kinds"] = kinds
    fields["sliding_window"] = _window_if_sliding(kinds, _int(config, "sliding_window", family, 4096))
    # Absent means Gemma 2's default cap of 50; an explicit null turns it off.
    cap = config.get("attn_logit_softcapping", 50.0)
    fields["attn_logit_softcapping"] = _float_or_none(cap, "attn_logit_softcapping", family)
    return fields


def _parse_gemma3_text(
    config: Mapping[str, Any], family: str, *, dtype_fallback: str = DEFAULT_DTYPE
) -> dict[str, Any]:
    text = {**_GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    fields = _attention_fields(text, family, head_dim_default=256, rope_theta_default=1_000_000.0)
    fields["dtype"] = _dtype(config, dtype_fallback)
    n = fields["num_hidden_layers"]
    kinds = _kinds_from_layer_types(text, n, family, _LAYER_TYPE_KINDS)
    if kinds is None:
        # Newer Transformers save the pattern as the private "_sliding_window_pattern".
        key = "_sliding_window_pattern" if "_sliding_window_pattern" in config else "sliding_window_pattern"
        pattern = _int(text, key, family)
        kinds = tuple(LayerKind.FULL if (i + 1) % pattern == 0 else LayerKind.SLIDING for i in range(n))
    fields["layer_kinds"] = kinds
    fields["sliding_window"] = _window_if_sliding(kinds, _int(text, "sliding_window", family))
    cap = text.get("attn_logit_softcapping")
    fields["attn_logit_softcapping"] = _float_or_none(cap, "attn_logit_softcapping", family)
    return fields


def _parse_gemma3(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The multimodal wrapper: the cache is the text tower's, and the model takes images."""
    text = config.get("text_config") or {}
    if not isinstance(text, Mapping):
        raise ConfigError("text_config", text, f"a {_where(family)}'s 'text_config' must be an object")
    fields = _parse_gemma3_text(text, f"{family} text_config", dtype_fallback=_dtype(config))
    fields["architectures"] = _architectures(config)
    fields["is_multimodal"] = True
    return fields


def _parse_deepseek(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    nope = _int(config, "qk_nope_head_dim", family)
    rope = _int(config, "qk_rope_head_dim", family)
    fields = _attention_fields(config, family, head_dim_default=nope + rope)
    n = fields["num_hidden_layers"]
    fields.update(
        layer_kinds=(LayerKind.MLA,) * n,
        num_kv_heads=1,
        # Some configs also carry head_dim (= qk_rope_head_dim); the K head is nope + rope.
        head_dim=nope + rope,
        v_head_dim=_int(config, "v_head_dim", family),
        kv_lora_rank=_int(config, "kv_lora_rank", family),
        qk_rope_head_dim=rope,
        num_nextn_predict_layers=_int(config, "num_nextn_predict_layers", family, 0, minimum=0),
    )
    if family == "deepseek_v32" or config.get("index_topk") is not None:
        fields["is_dsa"] = True
        fields["index_head_dim"] = _int(config, "index_head_dim", family)
    return fields


def gdn_state_spec(
    *,
    num_k_heads: int,
    num_v_heads: int,
    k_head_dim: int,
    v_head_dim: int,
    conv_kernel: int,
    conv_dtype: str = RECURRENT_CONV_DTYPE,
    ssm_dtype: str = RECURRENT_SSM_DTYPE,
) -> RecurrentStateSpec:
    """Per-request state of one gated-delta-net layer, unsharded (tensor-parallel size 1).

    The conv window holds the last ``conv_kernel - 1`` inputs of the q, k and v projections,
    ``[2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim, conv_kernel - 1]``. The recurrent
    matrix is ``[num_v_heads, v_head_dim, k_head_dim]``: SGLang's Mamba2 shape
    ``[heads, head_dim, state_size]`` with the value heads as heads and the key dim as state.
    """
    conv_dim = 2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim
    return RecurrentStateSpec(
        conv_state_shapes=((conv_dim, conv_kernel - 1),),
        conv_dtype=conv_dtype,
        ssm_state_shape=(num_v_heads, v_head_dim, k_head_dim),
        ssm_dtype=ssm_dtype,
    )


def _parse_qwen3_next(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    fields = _attention_fields(config, family, head_dim_default=256)
    n = fields["num_hidden_layers"]
    kinds = _kinds_from_layer_types(
        config, n, family, {"full_attention": LayerKind.FULL, "linear_attention": LayerKind.RECURRENT}
    )
    if kinds is None:
        interval = _int(config, "full_attention_interval", family, 4)
        kinds = tuple(LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.RECURRENT for i in range(n))
    fields["layer_kinds"] = kinds
    if LayerKind.RECURRENT in kinds:
        ssm_dtype = config.get("mamba_ssm_dtype") or RECURRENT_SSM_DTYPE
        if ssm_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("mamba_ssm_dtype", ssm_dtype, "use float32, bfloat16 or float16")
        fields["recurrent"] = gdn_state_spec(
            num_k_heads=_int(config, "linear_num_key_heads", family),
            num_v_heads=_int(config, "linear_num_value_heads", family),
            k_head_dim=_int(config, "linear_key_head_dim", family),
            v_head_dim=_int(config, "linear_value_head_dim", family),
            conv_kernel=_int(config, "linear_conv_kernel_dim", family, minimum=2),
            ssm_dtype=ssm_dtype,
        )
    fields["num_nextn_predict_layers"] = _int(config, "num_nextn_predict_layers", family, 0, minimum=0)
    return fields


# Each parser gets the config and its resolved model_type, and returns ModelSpec keyword arguments
# (all but name, model_type and extra).
_PARSERS: dict[str, Callable[[Mapping[str, Any], str], dict[str, Any]]] = {
    "llama": _parse_llama,
    "qwen2": _parse_qwen2,
    "qwen3": _parse_qwen2,
    "mistral": _parse_mistral,
    "gemma2": _parse_gemma2,
    "gemma3": _parse_gemma3,
    "gemma3_text": _parse_gemma3_text,
    "deepseek_v2": _parse_deepseek,
    "deepseek_v3": _parse_deepseek,
    "deepseek_v32": _parse_deepseek,
    "qwen3_next": _parse_qwen3_next,
}

_ARCHITECTURE_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "Qwen3NextForCausalLM": "qwen3_next",
}

# Known hybrids a one-kind-per-layer spec cannot describe yet.
_UNSUPPORTED = {
    "falcon_h1": "every Falcon-H1 layer runs attention and Mamba2 side by side, so a layer needs both a KV "
    "cache and a recurrent state; LayerKind has no kind for that yet",
    "nemotron_h": "Nemotron-H interleaves MLP/MoE-only layers that cache nothing; LayerKind has no kind for that yet",
}


def supported_model_types() -> tuple[str, ...]:
    """The ``model_type`` values `parse_hf_config` understands, sorted."""
    return tuple(sorted(_PARSERS))


def _model_type(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type:
        return str(model_type)
    for arch in _architectures(config):
        if arch in _ARCHITECTURE_TYPES:
            return _ARCHITECTURE_TYPES[arch]
    raise ConfigError(
        "model_type",
        None,
        f"add 'model_type' to config.json (one of {list(supported_model_types())}) or a known 'architectures' entry",
    )


def parse_hf_config(config: Mapping[str, Any], *, name: str | None = None) -> ModelSpec:
    """Build a `ModelSpec` from a Hugging Face ``config.json`` dict.

    ``name`` defaults to the config's ``_name_or_path``, else its ``model_type``. The raw config is
    kept, deep-copied, in ``spec.extra``. Raises `ConfigError` naming the key for an unknown or
    unsupported ``model_type`` and for missing or malformed keys.
    """
    if not isinstance(config, Mapping):
        raise ConfigError("config", type(config).__name__, "pass the parsed config.json as a dict")
    model_type = _model_type(config)
    if model_type in _UNSUPPORTED:
        raise ConfigError("model_type", model_type, f"not supported yet: {_UNSUPPORTED[model_type]}")
    parser = _PARSERS.get(model_type)
    if parser is None:
        raise ConfigError(
            "model_type", model_type, f"unsupported model family; use one of {list(supported_model_types())}"
        )
    fields = parser(config, model_type)
    if "Gemma3ForConditionalGeneration" in fields["architectures"]:
        fields["is_multimodal"] = True
    spec_name = name or config.get("_name_or_path") or model_type
    return ModelSpec(name=str(spec_name), model_type=model_type, extra=copy.deepcopy(dict(config)), **fields)
