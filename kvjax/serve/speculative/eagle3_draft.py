"""The EAGLE3 draft (SGLang's ``LlamaForCausalLMEagle3``, ``--speculative-algorithm EAGLE3``): one
Llama decoder layer that reads three of the target's hidden states, over a vocabulary of its own.

The target captures its residual stream at a few *boundaries* (boundary ``b``: what enters layer
``b``, the output of layer ``b - 1``; boundary ``num_hidden_layers``: the last layer's output
before the final norm), concatenated ``[T, n * target_hidden]`` (``CausalLM(capture_layers=...)``).
Which boundaries (`capture_boundaries`): the draft's ``eagle_config.eagle_aux_hidden_state_layer_ids``
``ids`` give ``id + 1`` each (the output of layer ``id``; for gpt-oss, ids whose largest is
``num_hidden_layers`` are boundaries already, as SGLang's gpt-oss keeps them), else SGLang's default
``(2, L // 2, L - 3)``: the outputs of layers ``1``, ``L / 2 - 1`` and ``L - 4``. The target
captures each boundary once, in layer order (SGLang's models test ``i in layers_to_capture`` as
they pass layer ``i``), so the concatenation is in ascending boundary order whatever order the
config lists, and a list that names a boundary twice (the default rule for fewer than 7 layers)
captures fewer states than the draft's ``fc`` reads: refused.

The draft (this module, weights in the checkpoint's names: ``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``; the token embedding is the target's, as SGLang's ``set_embed`` shares it)::

    h = fc(aux)                                 # project: [T, n * target_hidden] -> [T, hidden]
                                                # (input_norm / fc_norm first when the config asks)
    x = cat([input_layernorm(embed(token)), hidden_norm(h)])        # [T, 2 * hidden]
    r = h + self_attn(x)                        # q/k/v take 2 * hidden; KV at p in "kv_draft", layer 0
    r = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(r))                   # [S, draft_vocab_size] at meta.logits_indices
    proposal = argmax + d2t[argmax]             # a target token id (`target_ids`)
    out = r (norm(r) with ``norm_output``)      # the next step's h (EAGLE's chain; no fc again)

A draft step at position ``p`` takes the token there and ``h`` of position ``p - 1``: the target's
projected capture (the round's first step and the draft's re-run over verified tokens) or the
draft's own ``out`` (the round's later steps), as EAGLE's head (``eagle_head``). The projection is
per token, so the serving loop stores ``fc(aux)`` (``hidden`` values per KV slot) rather than
``aux`` (``n * target_hidden``): the same numbers at a third of the memory (kvjax's choice; SGLang
keeps ``aux`` of the last verified tokens in its batch, not per slot).

Without ``draft_vocab_size`` the head is the target's (``load_lm_head_from_target``): logits over
the target's vocabulary and no ``d2t``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.families.llama import LlamaAttention
from kvjax.serve.layers import MLP, BatchMetadata, Embedding, Linear, RMSNorm
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.speculative.draft_head import mha_trace_pools

__all__ = [
    "Eagle3Config",
    "LlamaEagle3Draft",
    "capture_boundaries",
    "eagle3_param_shapes",
]

DEFAULT_AUX_LAYERS = 3
"""Captured hidden states when the draft's config names none (SGLang's default)."""


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE3 draft's shapes and switches (frozen, hashable: compiled steps are cached per it).

    ``layer``: the draft's decoder layer as a Llama ``ModelConfig`` (one layer, the target's
    ``hidden_size`` and dtype; ``vocab_size`` is the logits' vocabulary: ``draft_vocab_size``, or
    the target's when the head is the target's; ``tie_word_embeddings``: logits through the
    target's embedding, a tied target's head). ``embed_vocab_size``: the target's vocabulary (the
    shared embedding). ``capture``: the target's boundaries (module docstring), in concatenation
    order; ``target_hidden_size``: each capture's width. ``fc_bias``, ``norm_before_fc`` (one
    RMSNorm over the concatenation, ``input_norm``), ``fc_norm`` (one RMSNorm per capture,
    ``fc_norm.i``), ``norm_output`` (the chained hidden state normed): the draft config's switches
    as SGLang reads them. ``token_map``: the checkpoint's ``d2t`` maps draft ids to target ids;
    ``own_head``: the draft's ``lm_head`` (else the target's).
    """

    layer: ModelConfig
    embed_vocab_size: int
    capture: tuple[int, ...]
    target_hidden_size: int
    fc_bias: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    token_map: bool = True
    own_head: bool = True

    @property
    def aux_width(self) -> int:
        """The width of the target's concatenated captures, ``len(capture) * target_hidden_size``."""
        return len(self.capture) * self.target_hidden_size


def capture_boundaries(family: str, num_layers: int, raw: Mapping[str, Any], path: Any) -> tuple[int, ...]:
    """The target's boundaries the draft reads, ascending (module docstring), from the draft's
    ``config.json`` ``raw``; ``ConfigError`` naming ``speculative_draft_model_path`` when one falls
    outside ``[0, num_layers]`` or the distinct boundaries are fewer or more than the states the
    draft's ``fc`` reads (``num_aux_hidden_states``, else one per listed layer, else 3)."""
    eagle_config = raw.get("eagle_config") or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, Mapping) else None
    if ids:
        ids = [int(i) for i in ids]
        keep = family == "gpt_oss" and max(ids) == num_layers  # SGLang's gpt-oss: boundaries already
        boundaries = tuple(ids) if keep else tuple(i + 1 for i in ids)
    else:
        boundaries = (2, num_layers // 2, num_layers - 3)
    bad = [b for b in boundaries if not 0 <= b <= num_layers]
    if bad:
        raise ConfigError(
            "speculative_draft_model_path",
            str(path),
            f"the EAGLE3 draft reads the target's hidden states at boundaries {list(boundaries)} (layer outputs "
            f"+ 1), outside the target's 0..{num_layers}: set eagle_config.eagle_aux_hidden_state_layer_ids to "
            "layers of this target",
        )
    count = raw.get("num_aux_hidden_states")
    reads = int(count) if count is not None else len(boundaries)
    captured = tuple(sorted(set(boundaries)))
    if len(captured) != reads:
        raise ConfigError(
            "speculative_draft_model_path",
            str(path),
            f"the draft's fc reads {reads} hidden states (num_aux_hidden_states) but the target captures "
            f"{len(captured)} (boundaries {list(captured)} of {list(boundaries)}, each once): make "
            f"eagle_config.eagle_aux_hidden_state_layer_ids list {reads} distinct layers of the target",
        )
    return captured


class _Eagle3Layer(nn.Module):
    """The draft's one decoder layer (``midlayer``): attention over the normed embedding and the
    normed hidden state side by side, the residual stream starting from the hidden state."""

    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(
        self, embeds: jax.Array, hidden: jax.Array, pools: CachePools, meta: BatchMetadata
    ) -> tuple[jax.Array, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        e = RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(embeds)
        h = RMSNorm(c.rms_norm_eps, dt, name="hidden_norm")(hidden)
        a, pools = LlamaAttention(c, self.layer_id, name="self_attn")(jnp.concatenate([e, h], axis=-1), pools, meta)
        x = hidden + a
        normed = RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        return x + MLP(c, name="mlp")(normed), pools


class LlamaEagle3Draft(nn.Module):
    """``(tokens [T], hidden [T, hidden], draft pools, meta) -> (logits [S, vocab] float32 at
    ``meta.logits_indices`` over the draft's vocabulary, every token's output hidden state [T,
    hidden], new pools)``: the call of ``nextn.NextNDraft`` (``eagle_steps`` runs either), with
    ``hidden`` already projected (`project`); `target_ids` maps its argmax to target ids.

    ``config``: the draft's `Eagle3Config`; ``layer_id``: the draft pool's layer (0).
    """

    config: Eagle3Config
    layer_id: int = 0

    def setup(self) -> None:
        cfg = self.config
        c = cfg.layer
        dt = jnp.dtype(c.dtype)
        self.embed_tokens = Embedding(cfg.embed_vocab_size, c.hidden_size, dt)
        self.fc = Linear(c.hidden_size, cfg.fc_bias, dt)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(c.rms_norm_eps, dt)
        if cfg.fc_norm:
            self.fc_norm = [RMSNorm(c.rms_norm_eps, dt) for _ in cfg.capture]
        self.midlayer = _Eagle3Layer(c, self.layer_id)
        self.norm = RMSNorm(c.rms_norm_eps, dt)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, False, dt)
        if cfg.token_map:
            self.d2t = self.param("d2t", nn.initializers.zeros, (c.vocab_size,), jnp.int32)

    def project(self, aux: jax.Array) -> jax.Array:
        """``[T, n * target_hidden]`` captures -> ``[T, hidden]`` (the draft's ``fc``, after its
        optional norms), in the weights' dtype."""
        cfg = self.config
        x = aux.astype(jnp.dtype(cfg.layer.dtype))
        if cfg.norm_before_fc:
            x = self.input_norm(x)
        if cfg.fc_norm:
            chunks = jnp.split(x, len(cfg.capture), axis=-1)
            x = jnp.concatenate([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], axis=-1)
        return self.fc(x)

    def __call__(
        self, tokens: jax.Array, hidden: jax.Array, pools: CachePools, meta: BatchMetadata
    ) -> tuple[jax.Array, jax.Array, CachePools]:
        c = self.config.layer
        x, pools = self.midlayer(self.embed_tokens(tokens), hidden.astype(jnp.dtype(c.dtype)), pools, meta)
        picked = self.norm(x[meta.logits_indices])
        logits = self.embed_tokens.attend(picked) if c.tie_word_embeddings else self.lm_head(picked)
        out = self.norm(x) if self.config.norm_output else x
        return logits.astype(jnp.float32), out, pools

    def target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """Draft vocabulary ids -> target ids (``id + d2t[id]``; the same ids without a map)."""
        if not self.config.token_map:
            return draft_ids
        return (draft_ids + self.d2t[draft_ids]).astype(jnp.int32)

    def trace(self, tokens: jax.Array, aux: jax.Array, pools: CachePools, meta: BatchMetadata) -> jax.Array:
        """Every submodule once (to create the weights): project, the layer, the token map."""
        logits, _, _ = self(tokens, self.project(aux), pools, meta)
        return self.target_ids(jnp.argmax(logits, axis=-1))


def eagle3_param_shapes(config: Eagle3Config) -> Any:
    """The draft's parameter tree (the shared embedding included) as ``jax.ShapeDtypeStruct``
    leaves (nothing allocated)."""
    from kvjax.attention import trace_metadata

    module = LlamaEagle3Draft(config)
    layer = config.layer
    args = (
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, config.aux_width), jnp.dtype(layer.dtype)),
        mha_trace_pools(layer, 0),
        trace_metadata(None),
    )
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *args, method=LlamaEagle3Draft.trace))["params"]
