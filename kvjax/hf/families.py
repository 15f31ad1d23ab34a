"""One record per model family (``model_type``): how its ``config.json`` is read, and what serves it.

Both sides read this table and nothing else about a family:

* planning (``kvjax.hf.parse_hf_fields``, jax-free): ``parse`` reads what the layers cache into
  `ModelSpec` keyword arguments, and ``architectures`` name the family when ``model_type`` is absent;
* serving (``kvjax.serve.families``, ``kvjax.serve.model_config``): a family with a ``model`` is
  servable; ``layer_kinds`` are the cached layer kinds its model runs (a spec with others is
  refused by name), ``read_config`` reads its own hyperparameters into ``ModelConfig.family_config``,
  ``trace_state`` builds the pools it traces its weights on, and the flags say which config keys
  the shared reader honours for it (RoPE variants, projection biases).

The serving entries are ``"module:name"`` strings, imported only when used (``Family.load``), so this
module, like all of ``kvjax.hf``, imports neither jax nor flax. Adding a family to plan is one
record with its parser; adding a servable one is the record's serving fields plus its model module
(``kvjax/serve/families/<family>.py``: its decoder layer on ``kvjax.serve.causal_lm``, its
``read_config`` and ``trace_state``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from kvjax.hf import attention, gemma, llava, mla, recurrent
from kvjax.hf.keys import Fields
from kvjax.layer_kinds import LayerKind

Parser = Callable[[Mapping[str, Any], str], Fields]

_SERVE = "kvjax.serve.families."
_FULL = frozenset({LayerKind.FULL})
_FULL_OR_SLIDING = frozenset({LayerKind.FULL, LayerKind.SLIDING})


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: the ``model_type`` of its ``config.json`` and everything kvjax does with it.

    Attributes:
        name: the ``model_type``.
        parse: ``(config dict, model_type) -> ModelSpec keyword arguments`` (planning).
        architectures: the ``architectures`` class names that mean this family.
        model: ``"module:Class"`` of its flax model (a ``kvjax.serve.causal_lm.CausalLM``), or None
            when kvjax plans but does not serve the family.
        layer_kinds: the layer kinds its model runs (``ModelSpec.layer_kinds`` must be a subset).
        read_config: ``"module:function"`` taking ``(spec, raw config dict)`` and returning the
            family's frozen hyperparameters (``ModelConfig.family_config``), or None.
        trace_state: ``"module:function"`` taking a ``ModelConfig`` and returning
            ``(CachePools, part)``: the smallest pools its model runs on and the
            ``AttentionMetadata`` kind part (``SWAMetadata``, ``StateMetadata`` or None) of a
            one-token batch (for tracing weights), or None for a one-page MHA pool and no part.
        partial_rotary: the model rotates part of the head dim itself (RoPE's
            ``partial_rotary_factor`` is then the family's to read, not refused).
        yarn_rope: the model applies ``RopeConfig.attention_scaling()`` (YaRN RoPE is then read,
            not refused).
        qkv_bias: q/k/v projections always carry biases and ``o_proj`` none, whatever
            ``attention_bias`` says (Qwen2); otherwise all four follow ``attention_bias``.
        mlp_bias: the MLP projections follow the config's ``mlp_bias`` (Llama); otherwise none.
        text_config: the key of ``config.json`` holding the language model's config (a
            vision-language model's ``text_config``), which the serving config is read from; None:
            the top level.
        checkpoint_prefix: what the checkpoint's tensor names put before the served model's
            (LLaVA's ``language_model.``); empty for a plain causal LM.
    """

    name: str
    parse: Parser
    architectures: tuple[str, ...] = ()
    model: str | None = None
    layer_kinds: frozenset[LayerKind] = _FULL
    read_config: str | None = None
    trace_state: str | None = None
    partial_rotary: bool = False
    yarn_rope: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    text_config: str | None = None
    checkpoint_prefix: str = ""

    @property
    def servable(self) -> bool:
        """Whether kvjax has a model for the family (else it is planned only)."""
        return self.model is not None

    def load(self, what: str) -> Callable[..., Any]:
        """Import ``model``, ``read_config`` or ``trace_state`` (named by attribute)."""
        target = getattr(self, what)
        if target is None:
            raise AttributeError(f"family {self.name!r} has no {what}")
        module, _, name = str(target).partition(":")
        return getattr(importlib.import_module(module), name)


def _served(name: str, parse: Parser, architecture: str, model: str, *, hooks: bool = True, **flags: Any) -> Family:
    """A servable family's record; ``model`` is ``"<module>:<Class>"`` under ``kvjax.serve.families``,
    and with ``hooks`` that module's ``read_config`` and ``trace_state`` are the family's (every
    family module with its own hyperparameters names them so)."""
    module = _SERVE + model.partition(":")[0]
    return Family(
        name,
        parse,
        (architecture,),
        model=_SERVE + model,
        read_config=f"{module}:read_config" if hooks else None,
        trace_state=f"{module}:trace_state" if hooks else None,
        **flags,
    )


_LLAMA = "llama:LlamaForCausalLM"  # also Mistral's and Qwen2's: their differences are biases and windows
_MAMBA_HYBRID = frozenset({LayerKind.FULL, LayerKind.RECURRENT, LayerKind.NONE})

FAMILY_RECORDS: tuple[Family, ...] = (
    _served("llama", attention.parse_llama, "LlamaForCausalLM", _LLAMA, layer_kinds=_FULL_OR_SLIDING, mlp_bias=True),
    _served("mistral", attention.parse_mistral, "MistralForCausalLM", _LLAMA, layer_kinds=_FULL_OR_SLIDING),
    _served("qwen2", attention.parse_qwen2, "Qwen2ForCausalLM", _LLAMA, layer_kinds=_FULL_OR_SLIDING, qkv_bias=True),
    _served("qwen3", attention.parse_qwen2, "Qwen3ForCausalLM", "qwen3:Qwen3ForCausalLM", hooks=False),
    _served(
        "gemma3_text",
        gemma.parse_gemma3_text,
        "Gemma3ForCausalLM",
        "gemma3:Gemma3ForCausalLM",
        layer_kinds=_FULL_OR_SLIDING,
    ),
    _served(
        "gpt_oss",
        attention.parse_gpt_oss,
        "GptOssForCausalLM",
        "gpt_oss:GptOssForCausalLM",
        layer_kinds=_FULL_OR_SLIDING,
        yarn_rope=True,
    ),
    _served(
        "nemotron_h",
        recurrent.parse_nemotron_h,
        "NemotronHForCausalLM",
        "nemotron_h:NemotronHForCausalLM",
        layer_kinds=_MAMBA_HYBRID,
    ),
    _served(
        "qwen3_next",
        recurrent.parse_qwen3_next,
        "Qwen3NextForCausalLM",
        "qwen3_next:Qwen3NextForCausalLM",
        layer_kinds=frozenset({LayerKind.FULL, LayerKind.RECURRENT}),
        partial_rotary=True,
    ),
    _served(
        "deepseek_v2",
        mla.parse_deepseek_mla,
        "DeepseekV2ForCausalLM",
        "deepseek_v2:DeepseekV2ForCausalLM",
        layer_kinds=frozenset({LayerKind.MLA}),
    ),
    _served(
        "deepseek_v3",
        mla.parse_deepseek_mla,
        "DeepseekV3ForCausalLM",
        "deepseek_v2:DeepseekV2ForCausalLM",
        layer_kinds=frozenset({LayerKind.MLA}),
    ),
    _served(
        "llava",
        llava.parse_llava,
        "LlavaForConditionalGeneration",
        "llava:LlavaLanguageModel",
        layer_kinds=_FULL_OR_SLIDING,
        mlp_bias=True,
        text_config="text_config",
        checkpoint_prefix="language_model.",
    ),
    # Planned, not served.
    Family("olmo2", attention.parse_llama, ("Olmo2ForCausalLM",)),
    Family("glm4", attention.parse_llama, ("Glm4ForCausalLM",)),
    Family("glm4_moe", attention.parse_llama, ("Glm4MoeForCausalLM",)),
    Family("deepseek", attention.parse_llama, ("DeepseekForCausalLM",)),
    Family("qwen2_moe", attention.parse_qwen2, ("Qwen2MoeForCausalLM",)),
    Family("qwen3_moe", attention.parse_qwen2, ("Qwen3MoeForCausalLM",)),
    Family("mixtral", attention.parse_mistral, ("MixtralForCausalLM",)),
    Family("phi3", attention.parse_mistral, ("Phi3ForCausalLM",)),
    Family("gemma2", gemma.parse_gemma2, ("Gemma2ForCausalLM",)),
    Family("gemma3", gemma.parse_gemma3, ("Gemma3ForConditionalGeneration",)),
    Family("deepseek_v32", mla.parse_deepseek_mla, ("DeepseekV32ForCausalLM",)),
    Family("falcon_h1", recurrent.parse_falcon_h1, ("FalconH1ForCausalLM",)),
    Family("minimax", recurrent.parse_minimax, ("MiniMaxForCausalLM",)),
    Family("minimax_m1", recurrent.parse_minimax, ("MiniMaxM1ForCausalLM",)),
    Family("minimax_text_01", recurrent.parse_minimax, ("MiniMaxText01ForCausalLM",)),
)

FAMILIES_BY_TYPE: Mapping[str, Family] = {record.name: record for record in FAMILY_RECORDS}
