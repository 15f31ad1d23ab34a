"""Families whose layers are plain attention: full, sliding, or a mix given by ``layer_types``.

Rules (Hugging Face's, per family):
  * ``llama``-like (Llama, OLMo-2, GLM-4 / GLM-4.5 MoE, DeepSeek-MoE ``deepseek``): every layer FULL,
    unless the config writes ``layer_types``.
  * ``qwen2`` / ``qwen3`` / ``qwen2_moe`` / ``qwen3_moe``: FULL, unless ``use_sliding_window`` is
    true; then layers with index ``>= max_window_layers`` are SLIDING. ``layer_types`` wins.
  * ``mistral`` / ``mixtral`` / ``phi3``: ``sliding_window`` null -> every layer FULL; set -> every
    layer SLIDING, except that a window at least as long as ``max_position_embeddings`` never
    slides anything and is planned as FULL (Phi-3-128k ships one).
  * ``gpt_oss``: ``layer_types`` (else alternating, sliding first), ``sliding_window`` tokens, and
    learned attention sinks (recorded as ``attention_sinks``; they are weights, not cache).
  * an unknown ``model_type`` that has the standard attention keys: read as a Llama-like model (with
    ``layer_types`` when present, every layer FULL otherwise) and a warning that says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvjax.hf import keys
from kvjax.hf.keys import ATTENTION_LAYER_TYPES, Fields
from kvjax.layer_kinds import LayerKind


def parse_llama(config: Mapping[str, Any], family: str) -> Fields:
    fields = keys.attention_fields(config, family)
    n = fields["num_hidden_layers"]
    kinds = keys.kinds_from_layer_types(config, n, family, ATTENTION_LAYER_TYPES)
    if kinds is None:
        kinds = (LayerKind.FULL,) * n
    fields["layer_kinds"] = kinds
    if LayerKind.SLIDING in kinds:
        fields["sliding_window"] = keys.integer(config, "sliding_window", family)
    fields["num_nextn_predict_layers"] = keys.integer(config, "num_nextn_predict_layers", family, 0, minimum=0)
    return fields


def parse_qwen2(config: Mapping[str, Any], family: str) -> Fields:
    fields = keys.attention_fields(config, family)
    n = fields["num_hidden_layers"]
    # Qwen2 configs ship a window even when it is off; only use_sliding_window turns it on.
    window = keys.integer(config, "sliding_window", family, None) if config.get("use_sliding_window") else None
    kinds = keys.kinds_from_layer_types(config, n, family, ATTENTION_LAYER_TYPES)
    if kinds is None:
        first_sliding = keys.integer(config, "max_window_layers", family, n, minimum=0) if window else n
        kinds = tuple(LayerKind.SLIDING if i >= first_sliding else LayerKind.FULL for i in range(n))
    elif LayerKind.SLIDING in kinds and window is None:
        window = keys.integer(config, "sliding_window", family)
    fields["layer_kinds"] = kinds
    fields["sliding_window"] = keys.window_if_sliding(kinds, window)
    return fields


def parse_mistral(config: Mapping[str, Any], family: str) -> Fields:
    fields = keys.attention_fields(config, family)
    n = fields["num_hidden_layers"]
    window = keys.integer(config, "sliding_window", family, None)
    if window is not None and window >= fields["context_length"]:
        window = None  # a window as long as the context never drops a token
    kind = LayerKind.SLIDING if window is not None else LayerKind.FULL
    fields["layer_kinds"] = (kind,) * n
    fields["sliding_window"] = window
    return fields


def parse_gpt_oss(config: Mapping[str, Any], family: str) -> Fields:
    fields = keys.attention_fields(config, family)
    keys.alternating_sliding_kinds(config, fields, family, 128)
    fields["attention_sinks"] = True
    return fields


def parse_unknown(config: Mapping[str, Any], family: str) -> Fields:
    """A ``model_type`` kvjax does not know, read from the standard attention keys with a warning."""
    fields = parse_llama(config, family)
    if config.get("layer_types") is not None:
        how = "from its layer_types"
    else:
        how = "as every layer full attention"
        if config.get("sliding_window") is not None:
            how += " (its sliding_window is ignored: without layer_types the sliding layers are unknown)"
    fields["warnings"].append(
        f"model_type '{family}' is not a family kvjax knows; its cache was read from the standard "
        f"attention keys {how}; check the plan against the model's own code"
    )
    return fields
