"""The servable families: the family records (``kvjax.hf.families``) that have a model (jax-free;
the model class and the family's config reader are imported only when used).

One small model file per family where the architecture differs, each a subclass of the shared
causal-LM skeleton (``kvjax.serve.causal_lm``) with its own decoder layer; shared layer pieces live
in ``kvjax.serve.layers``. ``llama`` also serves Mistral and Qwen2 (their differences are projection
biases, which the record's flags put in ``ModelConfig``, and sliding windows: Mistral's on every
layer, a pure sliding-window model); ``qwen3`` adds RMSNorms on q and k; ``gemma3_text`` runs
sliding-window and full layers over the hybrid-SWA pools; ``gpt_oss`` too, with attention sinks,
YaRN RoPE and its fused-expert MoE; ``deepseek_v2`` runs MLA over the latent pool and sparse-MoE
layers; ``nemotron_h`` and ``qwen3_next`` run recurrent mixers over the recurrent-state pool; ``llava`` is
Llama's stack with image rows merged after the embedding (its vision side, ``clip_vision`` and the
projector, runs outside the step: ``kvjax.serve.image_encoder``).

Adding a family is one model module and the serving fields of its record: the module's flax class
(a ``CausalLM``) takes ``(tokens [T], pools: CachePools, meta: AttentionMetadata)`` and returns
``(logits [S, vocab] float32, new pools)``; the record's fields are documented on `Family`.
"""

from __future__ import annotations

from typing import Any

from kvjax.errors import ConfigError
from kvjax.hf.families import FAMILY_RECORDS, Family

__all__ = ["FAMILIES", "SERVABLE_FAMILIES", "Family", "family"]

FAMILIES: dict[str, Family] = {record.name: record for record in FAMILY_RECORDS if record.servable}

SERVABLE_FAMILIES: tuple[str, ...] = tuple(FAMILIES)


def family(name: Any) -> Family:
    """The entry of ``model_type`` ``name``; a `ConfigError` naming the servable ones otherwise."""
    entry = FAMILIES.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ConfigError(
            "model_type",
            name,
            f"kvjax serves {list(SERVABLE_FAMILIES)} checkpoints; plan other families with `python -m kvjax plan`",
        )
    return entry
