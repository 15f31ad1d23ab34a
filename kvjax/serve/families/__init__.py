"""The servable families: one entry per Hugging Face ``model_type`` (jax-free; the model class and
the family's config reader are imported only when used).

One small model file per family where the architecture differs; shared pieces live in
``kvjax.serve.layers``. ``llama`` also serves Mistral and Qwen2 (their differences are projection
biases, which ``ModelConfig`` carries, and sliding windows: Mistral's on every layer, a pure
sliding-window model); ``qwen3`` adds RMSNorms on q and k; ``gemma3_text`` runs
sliding-window and full layers over the hybrid-SWA pools; ``gpt_oss`` too, with attention sinks,
YaRN RoPE and its fused-expert MoE; ``deepseek_v2`` runs MLA over the latent
pool and sparse-MoE layers.

Adding a family is one model module and one entry here: the module's flax class takes
``(tokens [T], pools: CachePools, meta: BatchMetadata)`` and returns ``(logits [S, vocab] float32,
new pools)``; ``layer_kinds`` says which cached layer kinds it runs (a spec with others is refused
by name); ``read_config`` (optional) reads the family's own hyperparameters from the raw
``config.json`` into a frozen, hashable object stored as ``ModelConfig.family_config``;
``trace_state`` (optional) builds the smallest ``CachePools`` of the family's pool kinds and the
``AttentionMetadata`` part its model reads (``kvjax.serve.trace_state``), used to trace the
weights' shapes (default: a one-page MHA pool, no part).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from kvjax.errors import ConfigError
from kvjax.layer_kinds import LayerKind


@dataclasses.dataclass(frozen=True)
class Family:
    """One servable family.

    Attributes:
        name: the ``model_type`` of its ``config.json``.
        model: ``"module:Class"`` of its flax model.
        layer_kinds: the layer kinds its model runs (``ModelSpec.layer_kinds`` must be a subset).
        read_config: ``"module:function"`` taking ``(spec, raw config dict)`` and returning the
            family's frozen hyperparameters (``ModelConfig.family_config``), or None.
        trace_state: ``"module:function"`` taking a ``ModelConfig`` and returning
            ``(CachePools, part)``: the smallest pools its model runs on and the
            ``AttentionMetadata`` part (``SWAMetadata``, ``StateMetadata`` or None) of a one-token
            batch (for tracing weights), or None for a one-page MHA pool and no part.
        partial_rotary: the model rotates part of the head dim itself (RoPE's
            ``partial_rotary_factor`` is then the family's to read, not refused).
        yarn_rope: the model applies ``RopeConfig.attention_scaling()`` (YaRN RoPE is then read,
            not refused).
    """

    name: str
    model: str
    layer_kinds: frozenset[LayerKind] = frozenset({LayerKind.FULL})
    read_config: str | None = None
    trace_state: str | None = None
    partial_rotary: bool = False
    yarn_rope: bool = False

    def load(self, what: str) -> Callable[..., Any]:
        """Import ``model``, ``read_config`` or ``trace_state`` (named by attribute)."""
        target = getattr(self, what)
        if target is None:
            raise AttributeError(f"family {self.name!r} has no {what}")
        module, _, name = str(target).partition(":")
        return getattr(importlib.import_module(module), name)


_LLAMA = "kvjax.serve.families.llama:LlamaForCausalLM"

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        *(
            Family(
                name,
                _LLAMA,
                layer_kinds=frozenset({LayerKind.FULL, LayerKind.SLIDING}),
                read_config="kvjax.serve.families.llama:read_windows",
                trace_state="kvjax.serve.families.llama:trace_state",
            )
            for name in ("llama", "mistral", "qwen2")
        ),
        Family("qwen3", "kvjax.serve.families.qwen3:Qwen3ForCausalLM"),
        Family(
            "gemma3_text",
            "kvjax.serve.families.gemma3:Gemma3ForCausalLM",
            layer_kinds=frozenset({LayerKind.FULL, LayerKind.SLIDING}),
            read_config="kvjax.serve.families.gemma3:read_gemma3_config",
            trace_state="kvjax.serve.families.gemma3:gemma3_trace_state",
        ),
        Family(
            "gpt_oss",
            "kvjax.serve.families.gpt_oss:GptOssForCausalLM",
            layer_kinds=frozenset({LayerKind.FULL, LayerKind.SLIDING}),
            read_config="kvjax.serve.families.gpt_oss:read_config",
            trace_state="kvjax.serve.families.gpt_oss:trace_state",
            yarn_rope=True,
        ),
        Family(
            "nemotron_h",
            "kvjax.serve.families.nemotron_h:NemotronHForCausalLM",
            layer_kinds=frozenset({LayerKind.FULL, LayerKind.RECURRENT, LayerKind.NONE}),
            read_config="kvjax.serve.families.nemotron_h:read_config",
            trace_state="kvjax.serve.families.nemotron_h:trace_state",
        ),
        Family(
            "qwen3_next",
            "kvjax.serve.families.qwen3_next:Qwen3NextForCausalLM",
            layer_kinds=frozenset({LayerKind.FULL, LayerKind.RECURRENT}),
            read_config="kvjax.serve.families.qwen3_next:read_config",
            trace_state="kvjax.serve.families.qwen3_next:trace_state",
            partial_rotary=True,
        ),
        Family(
            "deepseek_v2",
            "kvjax.serve.families.deepseek_v2:DeepseekV2ForCausalLM",
            layer_kinds=frozenset({LayerKind.MLA}),
            read_config="kvjax.serve.families.deepseek_v2:read_config",
            trace_state="kvjax.serve.families.deepseek_v2:trace_state",
        ),
    )
}

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
