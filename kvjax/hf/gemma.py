"""Gemma 2 and Gemma 3: sliding and full attention layers interleaved.

* ``gemma2``: even layers SLIDING, odd layers FULL (or ``layer_types``); explicit ``head_dim``;
  attention logit soft-capping (50 when absent, off when null).
* ``gemma3_text`` and the multimodal wrapper ``gemma3`` (``text_config``): ``layer_types``, else
  ``sliding_window_pattern`` N: every N-th layer FULL, the rest SLIDING. Missing text keys take
  Hugging Face's ``Gemma3TextConfig`` defaults, since its saved configs omit them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvjax.errors import ConfigError
from kvjax.hf import keys
from kvjax.hf.keys import ATTENTION_LAYER_TYPES, DEFAULT_DTYPE, Fields
from kvjax.layer_kinds import LayerKind

# Hugging Face ``Gemma3TextConfig`` defaults for the keys the spec reads. Saved Gemma 3 configs
# write only the text keys that differ from these, so they must be filled in here.
GEMMA3_TEXT_DEFAULTS: Mapping[str, Any] = {
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


def parse_gemma2(config: Mapping[str, Any], family: str) -> Fields:
    fields = keys.attention_fields(config, family, head_dim_default=256)
    keys.alternating_sliding_kinds(config, fields, family, 4096)
    # Absent means Gemma 2's default cap of 50; an explicit null turns it off.
    cap = config.get("attn_logit_softcapping", 50.0)
    fields["attn_logit_softcapping"] = keys.float_or_none(cap, "attn_logit_softcapping", family)
    return fields


def parse_gemma3_text(config: Mapping[str, Any], family: str, *, dtype_fallback: str = DEFAULT_DTYPE) -> Fields:
    text = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    fields = keys.attention_fields(text, family, head_dim_default=256, rope_theta_default=1_000_000.0)
    fields["dtype"] = keys.dtype(config, dtype_fallback)
    n = fields["num_hidden_layers"]
    kinds = keys.kinds_from_layer_types(text, n, family, ATTENTION_LAYER_TYPES)
    if kinds is None:
        # Newer Transformers save the pattern as the private "_sliding_window_pattern".
        key = "_sliding_window_pattern" if "_sliding_window_pattern" in config else "sliding_window_pattern"
        pattern = keys.integer(text, key, family)
        kinds = tuple(LayerKind.FULL if (i + 1) % pattern == 0 else LayerKind.SLIDING for i in range(n))
    fields["layer_kinds"] = kinds
    fields["sliding_window"] = keys.window_if_sliding(kinds, keys.integer(text, "sliding_window", family))
    cap = text.get("attn_logit_softcapping")
    fields["attn_logit_softcapping"] = keys.float_or_none(cap, "attn_logit_softcapping", family)
    return fields


def parse_gemma3(config: Mapping[str, Any], family: str) -> Fields:
    """The multimodal wrapper: the cache is the text tower's, and the model takes images."""
    text = config.get("text_config") or {}
    if not isinstance(text, Mapping):
        raise ConfigError("text_config", text, f"a {keys.where(family)}'s 'text_config' must be an object")
    fields = parse_gemma3_text(text, f"{family} text_config", dtype_fallback=keys.dtype(config))
    fields["architectures"] = keys.architectures(config)
    fields["is_multimodal"] = True
    return fields
