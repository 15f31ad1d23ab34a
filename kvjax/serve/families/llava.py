"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and a
Llama-family language model.

* `LlavaSettings` reads what the vision side needs from the checkpoint's ``config.json``:
  ``vision_config`` (a `ClipVisionConfig`), ``vision_feature_layer`` (one int, default -2),
  ``vision_feature_select_strategy`` (``"default"`` drops the CLS position, ``"full"`` keeps it),
  ``projector_hidden_act`` (default ``gelu``), ``multimodal_projector_bias`` (default true),
  ``image_token_id`` (or the older ``image_token_index``; default 32000) and the language model's
  ``hidden_size`` (``text_config``).
* `LlavaImageEncoder` (flax): ``pixel_values [N, C, H, W] -> [N, tokens_per_image, text hidden]``,
  what Transformers' ``get_image_features`` returns: the tower's chosen hidden states, the
  selection, then ``multi_modal_projector`` (``linear_1``, the activation, ``linear_2``).
  Parameter paths ``vision_tower.*`` and ``multi_modal_projector.*`` (the names under which
  Transformers saves them; ``kvjax.serve.image_encoder`` reads them).
* `LlavaLanguageModel`: the served model, the Llama family's stack with one change: after the
  token embedding, the rows the step's ``MultimodalMetadata`` flags are the images' embeddings
  (``kvjax.serve.multimodal_metadata``; pad ids above the vocabulary are clamped before the
  lookup). Its config is ``text_config`` and its tensors are ``language_model.*`` (the family
  record's ``text_config`` and ``checkpoint_prefix``); a ``llama`` or ``mistral`` language model
  is served (a ``qwen2`` one, whose projection biases the record does not say, is refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention import KindMetadata
from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.families import llama
from kvjax.serve.families.clip_vision import ClipVisionConfig, ClipVisionTower, activation
from kvjax.serve.families.llama import LlamaWindows
from kvjax.serve.layers import Linear
from kvjax.serve.model_config import ModelConfig
from kvjax.spec import ModelSpec

__all__ = ["LlavaImageEncoder", "LlavaLanguageModel", "LlavaProjector", "LlavaSettings", "read_config", "trace_state"]

#: The language model families served inside LLaVA.
TEXT_FAMILIES = ("llama", "mistral")


def read_config(spec: ModelSpec, raw: Mapping[str, Any]) -> LlamaWindows | None:
    """The language model's family config (``raw``: ``text_config``): Llama's sliding layers, or
    None; `ConfigError` for a language model family kvjax does not serve inside LLaVA."""
    text_type = raw.get("model_type") or "llama"
    if text_type not in TEXT_FAMILIES:
        raise ConfigError(
            "text_config.model_type",
            text_type,
            f"kvjax serves LLaVA with a {' or '.join(TEXT_FAMILIES)} language model",
        )
    return llama.read_config(spec, raw)


def trace_state(config: ModelConfig) -> tuple[CachePools, KindMetadata | None]:
    """Llama's: the pools of the language model's kinds."""
    return llama.trace_state(config)


class LlavaLanguageModel(llama.LlamaForCausalLM):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``, image rows
    merged after the embedding (module docstring)."""

    multimodal: bool = True


SELECT_STRATEGIES = ("default", "full")


@dataclasses.dataclass(frozen=True)
class LlavaSettings:
    """The vision side of a LLaVA checkpoint (module docstring); frozen and hashable."""

    vision: ClipVisionConfig
    text_hidden_size: int
    image_token_id: int = 32000
    feature_layer: int = -2
    select_strategy: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> LlavaSettings:
        """Read a LLaVA ``config.json``.

        Raises:
            ConfigError: a vision tower other than CLIP, several feature layers, an unknown
                selection strategy or activation, or a missing language model width.
        """
        vision_raw = raw.get("vision_config") or {}
        if not isinstance(vision_raw, Mapping):
            raise ConfigError("vision_config", vision_raw, "a LLaVA config.json's vision_config must be an object")
        vision = ClipVisionConfig.from_dict(vision_raw)
        text = raw.get("text_config") or {}
        hidden = text.get("hidden_size", 4096) if isinstance(text, Mapping) else None
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
            raise ConfigError("text_config.hidden_size", hidden, "must be a positive integer")
        layer = raw.get("vision_feature_layer", -2)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ConfigError(
                "vision_feature_layer", layer, "kvjax's LLaVA reads one feature layer (an int), not several"
            )
        vision.hidden_state_index(layer)
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ConfigError("vision_feature_select_strategy", strategy, f"use one of {list(SELECT_STRATEGIES)}")
        act = raw.get("projector_hidden_act", "gelu")
        activation(act, "projector_hidden_act")
        token = raw.get("image_token_id", raw.get("image_token_index", 32000))
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError("image_token_id", token, "must be a token id, an int >= 0")
        return cls(
            vision=vision,
            text_hidden_size=hidden,
            image_token_id=token,
            feature_layer=layer,
            select_strategy=strategy,
            projector_act=act,
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        )

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and embedding rows) per image: the patches, plus CLS with ``full``."""
        return self.vision.num_patches + (self.select_strategy == "full")


class LlavaProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: vision width -> text width."""

    settings: LlavaSettings
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.settings
        h = Linear(s.text_hidden_size, s.projector_bias, self.dtype, name="linear_1")(x)
        h = activation(s.projector_act, "projector_hidden_act")(h)
        return Linear(s.text_hidden_size, s.projector_bias, self.dtype, name="linear_2")(h)


class LlavaImageEncoder(nn.Module):
    """``pixel_values [N, C, H, W] -> [N, tokens_per_image, text hidden]`` (module docstring)."""

    settings: LlavaSettings
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        s = self.settings
        hidden = ClipVisionTower(s.vision, s.feature_layer, self.dtype, name="vision_tower")(pixel_values)
        if s.select_strategy == "default":
            hidden = hidden[:, 1:]
        return LlavaProjector(s, self.dtype, name="multi_modal_projector")(hidden)
