"""LLaVA (``model_type`` ``llava``, ``LlavaForConditionalGeneration``): a vision tower, a projector
and a language model; the cache is the language model's, read from ``text_config``.

``text_config`` names its own ``model_type`` (``llama`` when absent, Transformers' default): a
``llama``, ``mistral`` or ``qwen2`` language model is read by that family's parser; any other is
refused naming it. Checkpoints saved by older Transformers write only the keys that differ from
the text family's defaults (``llava-hf/llava-1.5-7b-hf``'s ``text_config`` has no
``num_hidden_layers``); the missing standard keys are filled with the defaults Transformers'
config class of that family has (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, as
Transformers 5 builds the config), and a warning names each key so filled.

The vision tower caches nothing (its outputs go to ``kvjax.multimodal.EmbeddingCache``), so the
plan is the language model's with ``is_multimodal`` set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvjax.errors import ConfigError
from kvjax.hf import attention, keys
from kvjax.hf.keys import Fields

#: Transformers' defaults of the standard keys, per text family (its config classes' defaults).
TEXT_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 32768,
    },
}

_TEXT_PARSERS = {"llama": attention.parse_llama, "mistral": attention.parse_mistral, "qwen2": attention.parse_qwen2}


def parse_llava(config: Mapping[str, Any], family: str) -> Fields:
    """The language model's cache fields, ``is_multimodal`` set (module docstring).

    Raises:
        ConfigError: ``text_config`` is not an object, or names a language model family kvjax
            does not read inside LLaVA.
    """
    text = config.get("text_config")
    text = {} if text is None else text
    if not isinstance(text, Mapping):
        raise ConfigError("text_config", text, f"a {keys.where(family)}'s 'text_config' must be an object")
    text_type = text.get("model_type") or "llama"
    parser = _TEXT_PARSERS.get(text_type)
    if parser is None:
        raise ConfigError(
            "text_config.model_type",
            text_type,
            f"kvjax reads a {family} language model of the families {', '.join(sorted(_TEXT_PARSERS))}",
        )
    defaults = TEXT_DEFAULTS[text_type]
    filled = {k: v for k, v in defaults.items() if text.get(k) is None}
    where = f"{family} text_config"
    fields = parser({**text, **filled}, where)
    fields["dtype"] = keys.dtype(text, keys.dtype(config))
    fields["architectures"] = keys.architectures(config)
    fields["is_multimodal"] = True
    warnings = list(fields.get("warnings", ()))
    warnings += [
        f"{where}: no {key}; read Transformers' {text_type} default {value}" for key, value in sorted(filled.items())
    ]
    fields["warnings"] = tuple(warnings)
    return fields
