"""Read a Hugging Face ``config.json`` dict into `ModelSpec` keyword arguments.

One small parser per model family, picked by ``model_type`` (or, when that key is absent, by the
first known entry of ``architectures``) from the family records (``kvjax.hf.families``, which the
serving side reads too). Each reads only the keys that decide what the layers cache
and raises `ConfigError` naming every missing or unusable key. The family rules are in the
docstrings of ``attention`` (plain attention families), ``gemma``, ``mla`` and ``recurrent``.

This package returns plain dicts and imports nothing of `ModelSpec`: ``kvjax.spec`` imports it, and
never the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvjax.errors import ConfigError
from kvjax.hf import attention
from kvjax.hf.families import FAMILY_RECORDS, Parser
from kvjax.hf.keys import Fields, architectures

# Each parser gets the config and its resolved model_type, and returns ModelSpec keyword arguments
# (all but name, model_type and extra). Both maps are views of the family records.
PARSERS: Mapping[str, Parser] = {record.name: record.parse for record in FAMILY_RECORDS}

ARCHITECTURE_TYPES: Mapping[str, str] = {
    architecture: record.name for record in FAMILY_RECORDS for architecture in record.architectures
}

# Keys that mean "this model keeps a state the standard attention keys do not describe". An unknown
# model_type carrying one is refused rather than planned as plain attention.
_NON_ATTENTION_KEY_PREFIXES = (
    "mamba",
    "ssm_",
    "linear_",
    "attn_type_list",
    "hybrid_override_pattern",
    "layers_block_type",
)

# The keys the generic reader cannot do without (head_dim may come from hidden_size / heads).
STANDARD_ATTENTION_KEYS = (
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "vocab_size",
    "max_position_embeddings",
)


def supported_model_types() -> tuple[str, ...]:
    """The ``model_type`` values kvjax has a family parser for, sorted."""
    return tuple(sorted(PARSERS))


def resolve_model_type(config: Mapping[str, Any]) -> str:
    """``model_type``, or the family of the first known ``architectures`` entry."""
    model_type = config.get("model_type")
    if model_type:
        return str(model_type)
    for arch in architectures(config):
        if arch in ARCHITECTURE_TYPES:
            return ARCHITECTURE_TYPES[arch]
    raise ConfigError(
        "model_type",
        None,
        f"add 'model_type' to config.json (one of {list(supported_model_types())}) or a known 'architectures' entry",
    )


def _unknown_family(config: Mapping[str, Any], model_type: str) -> Fields:
    families = list(supported_model_types())
    odd = sorted(k for k in config if k.startswith(_NON_ATTENTION_KEY_PREFIXES))
    if odd:
        fix = (
            f"not a family kvjax knows, and its keys {odd} describe layers the standard attention keys "
            f"do not (a recurrent or linear-attention state); supported families: {families}"
        )
        raise ConfigError("model_type", model_type, fix)
    if config.get("is_encoder_decoder"):
        raise ConfigError(
            "model_type", model_type, f"an encoder-decoder model; kvjax plans decoder caches ({families})"
        )
    missing = [k for k in STANDARD_ATTENTION_KEYS if config.get(k) is None]
    if missing:
        nested = ""
        if isinstance(config.get("text_config"), Mapping):
            nested = " (its decoder keys sit under text_config, a wrapper kvjax reads only for gemma3)"
        fix = (
            f"unsupported model family without the standard attention keys (missing {missing}){nested}; "
            f"use one of {families} or add those keys"
        )
        raise ConfigError("model_type", model_type, fix)
    return attention.parse_unknown(config, model_type)


def parse_hf_fields(config: Mapping[str, Any]) -> tuple[str, Fields]:
    """``(model_type, ModelSpec keyword arguments)`` for a Hugging Face config dict.

    The keyword arguments exclude ``name``, ``model_type`` and ``extra``; ``warnings`` is a tuple of
    the assumptions made. Raises `ConfigError` for an unusable config.
    """
    if not isinstance(config, Mapping):
        raise ConfigError("config", type(config).__name__, "pass the parsed config.json as a dict")
    model_type = resolve_model_type(config)
    parser = PARSERS.get(model_type)
    fields = parser(config, model_type) if parser is not None else _unknown_family(config, model_type)
    if "Gemma3ForConditionalGeneration" in fields["architectures"]:
        fields["is_multimodal"] = True
    fields["warnings"] = tuple(fields.get("warnings", ()))
    return model_type, fields
