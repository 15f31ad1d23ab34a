"""An EAGLE draft head for a full-attention Llama target (SGLang's ``LlamaForCausalLMEagle``).

A separate checkpoint (``--speculative-draft-model-path DIR`` with ``--speculative-algorithm
EAGLE``) whose ``config.json`` names the architecture ``LlamaForCausalLMEagle`` and whose tensors
are, without a ``model.`` prefix (SGLang's loader adds it): ``fc.weight`` ``[hidden, 2 * hidden]``
and ``fc.bias`` ``[hidden]``, and one Llama decoder layer ``layers.0.*`` *without* its
``input_layernorm`` (EAGLE's first layer reads ``fc``'s output directly). Its embedding and LM head
are the target's (SGLang's EAGLE worker shares them: ``set_embed_and_head``; an ``embed_tokens`` or
``lm_head`` tensor in the checkpoint is not read). A draft step at position ``p`` takes the token
there and a hidden state ``h`` (the target's final-normed hidden state at ``p - 1``, or the head's
own output of the step before: EAGLE's chain)::

    x = fc([embed(token), h])             # no norms before fc (unlike an MTP layer)
    x = x + self_attn(x)                  # writes the head's KV at p (pool "kv_draft", layer 0)
    x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(x)                   # no final norm; x is also the output hidden state

The head is built with the target's layer shapes (``config``: the target's serving config), so its
``config.json`` must agree with the target's on ``hidden_size``, ``intermediate_size``,
``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``, ``rms_norm_eps`` and the RoPE base
(EAGLE heads are trained as one more layer of their target: the released ones do); anything else
is refused by name (`load_eagle_head`). Its KV is the cache's draft pool ``"kv_draft"`` planned
for ``speculative_algorithm="EAGLE"`` without a draft spec (one layer of the target's attention
layout, layer id 0, ``kvjax.plan.draft``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.families.llama import LlamaAttention
from kvjax.serve.layers import MLP, BatchMetadata, Embedding, Linear, RMSNorm
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.speculative.draft_head import draft_logits

__all__ = [
    "EAGLE_HEAD_ARCHITECTURE",
    "EAGLE_HEAD_FAMILIES",
    "LlamaEagleHead",
    "check_head_config",
    "is_eagle_head",
]

EAGLE_HEAD_ARCHITECTURE = "LlamaForCausalLMEagle"
EAGLE_HEAD_FAMILIES = ("llama",)
"""The target families an EAGLE head drafts for (full-attention Llama-like targets)."""

#: ``config.json`` keys the head must share with its target (its layer is built with the target's shapes).
_SHARED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
)


class _EagleLayer(nn.Module):
    """Llama's decoder layer without ``input_layernorm`` (EAGLE's first layer)."""

    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        h, pools = LlamaAttention(c, self.layer_id, name="self_attn")(x, pools, meta)
        x = x + h
        normed = RMSNorm(c.rms_norm_eps, jnp.dtype(c.dtype), name="post_attention_layernorm")(x)
        return x + MLP(c, name="mlp")(normed), pools


class LlamaEagleHead(nn.Module):
    """``(tokens [T], hidden [T, hidden], draft pools, meta) -> (logits [S, vocab] float32 at
    ``meta.logits_indices``, every token's output hidden state [T, hidden], new pools)``: the call of
    ``nextn.NextNDraft`` (``eagle_steps`` runs either).

    ``config``: the target's serving config (the head has its shapes); ``layer_id``: the draft
    pool's layer (0).
    """

    config: ModelConfig
    layer_id: int = 0

    @nn.compact
    def __call__(
        self, tokens: jax.Array, hidden: jax.Array, pools: CachePools, meta: BatchMetadata
    ) -> tuple[jax.Array, jax.Array, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        embed = Embedding(c.vocab_size, c.hidden_size, dt, name="embed_tokens")
        x = Linear(c.hidden_size, True, dt, name="fc")(jnp.concatenate([embed(tokens), hidden.astype(dt)], axis=-1))
        out, pools = _EagleLayer(c, self.layer_id, name="layers_0")(x, pools, meta)
        return draft_logits(c, embed, out, meta), out, pools


def is_eagle_head(directory: str | Path) -> bool:
    """Whether ``directory``'s ``config.json`` names the EAGLE head's architecture."""
    file = Path(directory) / "config.json"
    if not file.is_file():
        return False
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return EAGLE_HEAD_ARCHITECTURE in (raw.get("architectures") or [])


def check_head_config(target: ModelConfig, raw: dict[str, Any], target_raw: dict[str, Any], path: Any) -> None:
    """``ConfigError`` naming ``speculative_draft_model_path`` and the key when the head's
    ``config.json`` (``raw``) does not fit ``target`` (``target_raw``: the target's ``config.json``,
    or its spec's extra fields): a target family without EAGLE heads, a sliding-window target, one
    layer other than 1, or a shape key or the RoPE base that differs."""
    if target.family not in EAGLE_HEAD_FAMILIES or target.family_config is not None:
        raise ConfigError(
            "speculative_draft_model_path",
            str(path),
            f"an EAGLE head ({EAGLE_HEAD_ARCHITECTURE}) drafts for a full-attention Llama target, not a "
            f"{target.family!r} one{' with sliding windows' if target.family_config is not None else ''}",
        )
    layers = int(raw.get("num_hidden_layers") or 0)
    if layers != 1:
        raise ConfigError(
            "speculative_draft_model_path",
            str(path),
            f"the EAGLE head has num_hidden_layers={layers}; kvjax serves one-layer heads (EAGLE-1/2's)",
        )
    for key in _SHARED_KEYS:
        if key in raw and key in target_raw and raw[key] != target_raw[key]:
            raise ConfigError(
                "speculative_draft_model_path",
                str(path),
                f"the EAGLE head's {key} is {raw[key]}, the target's {target_raw[key]}: a head trained for this target",
            )
    if _rope_theta(raw) != _rope_theta(target_raw):
        raise ConfigError(
            "speculative_draft_model_path",
            str(path),
            f"the EAGLE head's RoPE base is {_rope_theta(raw)}, the target's {_rope_theta(target_raw)}",
        )


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
