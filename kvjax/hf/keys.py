"""Readers for Hugging Face ``config.json`` keys, shared by every family parser.

Each reader names the key and the config it came from in its `ConfigError`, so a message reads
``num_hidden_layers=None: a llama config needs 'num_hidden_layers'; add it to config.json``.
Parsers return `ModelSpec` keyword arguments as a plain dict (``Fields``); assumptions they make go
to ``fields["warnings"]``, a list of sentences.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvjax.errors import ConfigError
from kvjax.layer_kinds import LayerKind

Fields = dict[str, Any]

MISSING: Any = object()

DEFAULT_DTYPE = "bfloat16"

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

# ``layer_types`` entries that are plain attention, in every family that writes them.
ATTENTION_LAYER_TYPES: Mapping[str, LayerKind] = {
    "full_attention": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
}


def where(family: str) -> str:
    """How messages name the config being read (``"llama config"``, ``"gemma3 text_config"``)."""
    return family if family.endswith("config") else f"{family} config"


def require(config: Mapping[str, Any], keys: Iterable[str], family: str) -> None:
    """Raise one `ConfigError` naming *every* key of ``keys`` that is absent or null."""
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        names = ", ".join(f"'{k}'" for k in missing)
        them = "it" if len(missing) == 1 else "them"
        raise ConfigError(", ".join(missing), None, f"a {where(family)} needs {names}; add {them} to config.json")


def get(config: Mapping[str, Any], key: str, family: str, default: Any = MISSING) -> Any:
    """``config[key]``, or ``default``; a missing key without a default is a `ConfigError`."""
    value = config.get(key, None)
    if value is None:
        if default is MISSING:
            raise ConfigError(key, None, f"a {where(family)} needs '{key}'; add it to config.json")
        return default
    return value


def integer(config: Mapping[str, Any], key: str, family: str, default: Any = MISSING, *, minimum: int = 1) -> Any:
    """An integer key (``>= minimum``); integral floats such as ``4096.0`` are accepted.

    Returns ``default`` unchecked when the key is absent or null (so ``default=None`` means optional).
    """
    if config.get(key) is None and default is not MISSING:
        return default
    value = get(config, key, family)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ConfigError(key, value, f"'{key}' in a {where(family)} must be an integer")
    if value < minimum:
        raise ConfigError(key, value, f"'{key}' in a {where(family)} must be >= {minimum}")
    return int(value)


def first_integer(config: Mapping[str, Any], keys: tuple[str, ...], family: str, default: Any = MISSING) -> Any:
    """The first of ``keys`` that is set (families spell the same fact differently)."""
    for key in keys:
        if config.get(key) is not None:
            return integer(config, key, family)
    if default is MISSING:
        names = " or ".join(f"'{k}'" for k in keys)
        raise ConfigError(keys[0], None, f"a {where(family)} needs {names}; add it to config.json")
    return default


def positive_number(config: Mapping[str, Any], key: str, family: str, default: Any = MISSING) -> Any:
    """A number key ``> 0``, as a float; ``default`` unchecked when the key is absent or null (so
    ``default=None`` means optional)."""
    if config.get(key) is None and default is not MISSING:
        return default
    value = get(config, key, family)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(key, value, f"'{key}' in a {where(family)} must be a positive number")
    return float(value)


def float_or_none(value: Any, key: str, family: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, value, f"'{key}' in a {where(family)} must be a number or null")
    return float(value)


def dtype(config: Mapping[str, Any], fallback: str = DEFAULT_DTYPE) -> str:
    """The weights' dtype from ``dtype`` (Transformers 5) or ``torch_dtype``; absent -> ``fallback``."""
    key = "dtype" if config.get("dtype") is not None else "torch_dtype"
    raw = config.get(key)
    if raw is None or raw == "auto":
        return fallback
    name = str(raw).removeprefix("torch.").lower()
    if name not in _DTYPE_NAMES:
        raise ConfigError(key, raw, f"use one of {sorted(set(_DTYPE_NAMES.values()))} (or omit it for {fallback})")
    return _DTYPE_NAMES[name]


def rope_theta(config: Mapping[str, Any], default: float) -> float:
    """``rope_theta``, or the one under ``rope_parameters`` (Transformers 5; per layer type for Gemma 3)."""
    family = str(config.get("model_type"))
    if config.get("rope_theta") is not None:
        theta = float_or_none(config["rope_theta"], "rope_theta", family)
        return default if theta is None else theta
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        if isinstance(params.get("full_attention"), Mapping):
            params = params["full_attention"]
        if params.get("rope_theta") is not None:
            theta = float_or_none(params["rope_theta"], "rope_parameters.rope_theta", family)
            return default if theta is None else theta
    return float(default)


def architectures(config: Mapping[str, Any]) -> tuple[str, ...]:
    archs = config.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    return tuple(str(a) for a in archs)


def kinds_from_layer_types(
    config: Mapping[str, Any], num_layers: int, family: str, allowed: Mapping[str, LayerKind], key: str = "layer_types"
) -> tuple[LayerKind, ...] | None:
    """Kinds from an explicit per-layer list (``layer_types``), or ``None`` when the config has none."""
    types = config.get(key)
    if types is None:
        return None
    if isinstance(types, str) or not isinstance(types, (list, tuple)):
        raise ConfigError(key, types, f"give a list of {sorted(allowed)} with one entry per layer")
    if len(types) != num_layers:
        fix = f"give exactly one entry per layer (num_hidden_layers={num_layers})"
        raise ConfigError(key, f"{len(types)} entries", fix)
    unknown = sorted({str(t) for t in types} - set(allowed))
    if unknown:
        raise ConfigError(key, unknown, f"a {where(family)} supports layer types {sorted(allowed)}")
    return tuple(allowed[str(t)] for t in types)


def window_if_sliding(kinds: tuple[LayerKind, ...], window: int | None) -> int | None:
    """The spec carries a window only when some layer slides (a `ModelSpec` invariant)."""
    return window if LayerKind.SLIDING in kinds else None


def alternating_sliding_kinds(config: Mapping[str, Any], fields: Fields, family: str, default_window: int) -> None:
    """Set ``fields``' ``layer_kinds`` from ``layer_types`` (else alternating, sliding first: Gemma 2,
    gpt-oss) and its ``sliding_window`` (``default_window`` tokens when the key is absent)."""
    n = fields["num_hidden_layers"]
    kinds = kinds_from_layer_types(config, n, family, ATTENTION_LAYER_TYPES)
    if kinds is None:
        kinds = tuple(LayerKind.SLIDING if i % 2 == 0 else LayerKind.FULL for i in range(n))
    fields["layer_kinds"] = kinds
    fields["sliding_window"] = window_if_sliding(kinds, integer(config, "sliding_window", family, default_window))


def attention_fields(
    config: Mapping[str, Any],
    family: str,
    *,
    head_dim_default: int | None = None,
    rope_theta_default: float = 10000.0,
    kv_heads_default: int | None = None,
) -> Fields:
    """The standard attention keys every decoder family shares.

    Reads ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (absent: MHA, with
    a warning, unless the family states its own default), ``head_dim`` (absent: ``hidden_size //
    num_attention_heads``), ``hidden_size``, ``vocab_size``, ``max_position_embeddings``, the dtype
    and rope. Every missing required key is named in one error.
    """
    required = ["num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size", "max_position_embeddings"]
    require(config, required, family)
    layers = integer(config, "num_hidden_layers", family)
    heads = integer(config, "num_attention_heads", family)
    hidden = integer(config, "hidden_size", family)
    warnings: list[str] = []
    if head_dim_default is None and config.get("head_dim") is None:
        if hidden % heads:
            fix = f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}; set 'head_dim'"
            raise ConfigError("head_dim", None, fix)
        head_dim_default = hidden // heads
    head_dim = integer(config, "head_dim", family, head_dim_default)
    if config.get("num_key_value_heads") is None and kv_heads_default is None:
        warnings.append(
            f"{where(family)} has no num_key_value_heads: planned as multi-head attention with "
            f"{heads} KV heads (num_attention_heads); set num_key_value_heads if the model uses fewer"
        )
    kv_heads = integer(config, "num_key_value_heads", family, kv_heads_default or heads)
    return {
        "architectures": architectures(config),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "v_head_dim": head_dim,
        "hidden_size": hidden,
        "vocab_size": integer(config, "vocab_size", family),
        "context_length": integer(config, "max_position_embeddings", family),
        "dtype": dtype(config),
        "rope_theta": rope_theta(config, rope_theta_default),
        "intermediate_size": integer(config, "intermediate_size", family, 0, minimum=0),
        "warnings": warnings,
    }
