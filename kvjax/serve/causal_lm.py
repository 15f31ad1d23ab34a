"""The causal-LM skeleton every served family shares: the token embedding, the loop over decoder
layers, the final norm and the LM head, and the pre-norm residual decoder layer most families use.

A family's model is a subclass of `CausalLM` that names its decoder layer (a module built as
``layer(config, layer_id)`` and called as ``(x [T, hidden], pools, meta) -> (x, pools)``) and,
where it differs from Llama, its final norm class, its checkpoint names and its embedding scale.
A family's decoder layer is usually a subclass of `DecoderLayer`, which holds the residual wiring
and asks the family for its token mixer (attention, a recurrent mixer) and its MLP.

Parameter paths keep Hugging Face's names (``kvjax.serve.checkpoint`` maps them one to one):
``{stack}.{embed}.weight``, ``{stack}.layers_{i}.*``, ``{stack}.{norm}.weight`` and ``lm_head.weight``
(absent when the head is tied to the embedding), with ``stack``/``embed``/``norm`` from
`StackNames` (``model`` / ``embed_tokens`` / ``norm``; Nemotron-H's checkpoints say ``backbone`` /
``embeddings`` / ``norm_f``).

A forward takes one flat ragged batch (``T`` tokens of up to ``S`` sequence rows,
``BatchMetadata``) and the cache's pools (``CachePools``: each layer uses the pool of its kind) and
returns ``(logits [S, vocab] float32, new pools)``: the logits of each row's last token
(``meta.logits_indices``) only, soft-capped when the family sets a cap.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.pools import CachePools
from kvjax.serve.layers import MLP, BatchMetadata, Embedding, Linear, RMSNorm
from kvjax.serve.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StackNames:
    """The checkpoint names of the decoder stack, its token embedding and its final norm."""

    stack: str = "model"
    embed: str = "embed_tokens"
    norm: str = "norm"


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (``{names.stack}.*`` in checkpoints).

    Returns the final-normed hidden states of each row's last token, ``[S, hidden]``, or, with
    ``tied_head``, their logits through the embedding (``[S, vocab]``, the weights' dtype).
    """

    config: ModelConfig
    decoder_layer: type[nn.Module]
    final_norm: type[nn.Module]
    final_norm_eps: float
    names: StackNames
    scale_embedding: bool
    tied_head: bool

    @nn.compact
    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        embed = Embedding(c.vocab_size, c.hidden_size, dt, name=self.names.embed)
        x = embed(tokens)
        if self.scale_embedding:  # Gemma: sqrt(hidden), the scale cast to the weights' dtype
            x = x * jnp.asarray(c.hidden_size**0.5, jnp.float32).astype(x.dtype)
        for i in range(c.num_hidden_layers):
            x, pools = self.decoder_layer(c, i, name=f"layers_{i}")(x, pools, meta)
        x = self.final_norm(self.final_norm_eps, dt, name=self.names.norm)(x[meta.logits_indices])
        return (embed.attend(x) if self.tied_head else x), pools


class CausalLM(nn.Module):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``.

    A family subclasses it and sets ``decoder_layer``; ``final_norm`` (a norm class built as
    ``norm(eps, dtype)``), ``names`` and ``scale_embedding`` default to Llama's, and the hooks
    ``final_norm_eps`` and ``logit_softcap`` may be overridden.
    """

    config: ModelConfig
    decoder_layer: type[nn.Module]
    final_norm: type[nn.Module] = RMSNorm
    names: StackNames = StackNames()
    scale_embedding: bool = False

    @nn.nowrap
    def final_norm_eps(self) -> float:
        """The final norm's epsilon (``rms_norm_eps``)."""
        return self.config.rms_norm_eps

    @nn.nowrap
    def logit_softcap(self) -> float | None:
        """``cap`` of ``cap * tanh(logits / cap)`` on the float32 logits, or None (no cap)."""
        return None

    @nn.compact
    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        stack = DecoderStack(
            c,
            self.decoder_layer,
            self.final_norm,
            self.final_norm_eps(),
            self.names,
            self.scale_embedding,
            c.tie_word_embeddings,
            name=self.names.stack,
        )
        x, pools = stack(tokens, pools, meta)
        logits = x if c.tie_word_embeddings else Linear(c.vocab_size, False, jnp.dtype(c.dtype), name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        cap = self.logit_softcap()
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits, pools


class LayerMixer(nn.Module):
    """The base of a layer's token mixer (an attention or a recurrent mixer) that goes through the
    cache: called as ``(x [T, hidden], pools, meta) -> (out [T, hidden], pools with the layer's
    cache written)``. ``layer_id`` is the model's global layer id, a Python int: the pool and the
    kernel are chosen from it at trace time."""

    config: ModelConfig
    layer_id: int


class DecoderLayer(nn.Module):
    """A residual decoder layer: ``x + mixer(input_layernorm(x))``, then
    ``x + mlp(post_attention_layernorm(x))`` (Llama's pre-norm layer).

    With ``sandwich_norms`` (Gemma 3) the mixer's and the MLP's outputs are normed too before their
    residual adds: ``post_attention_layernorm`` on the mixer's output, ``pre_feedforward_layernorm``
    before the MLP and ``post_feedforward_layernorm`` after it. A family sets ``norm`` (a class
    built as ``norm(eps, dtype)``) and ``attention`` (its `LayerMixer` class, built as
    ``self_attn``), or implements ``mixer`` instead; ``mlp`` builds the feed-forward block. Both
    build the layer's named submodules (``self_attn``, ``linear_attn``, ``mlp``, ...).
    """

    config: ModelConfig
    layer_id: int

    norm: ClassVar[type[nn.Module]] = RMSNorm
    sandwich_norms: ClassVar[bool] = False
    attention: ClassVar[type[nn.Module] | None] = None

    @nn.nowrap
    def mixer(self) -> nn.Module:
        """The token mixer, called as ``(x, pools, meta) -> (x, pools)``: by default the family's
        ``attention`` built as ``self_attn``."""
        if self.attention is None:
            raise NotImplementedError(f"{type(self).__name__} sets neither attention nor mixer")
        return self.attention(self.config, self.layer_id, name="self_attn")

    @nn.nowrap
    def mlp(self) -> nn.Module:
        """The feed-forward block, called as ``x -> x`` (default: the SwiGLU ``MLP``)."""
        return MLP(self.config, name="mlp")

    @nn.nowrap
    def _norm(self, name: str) -> nn.Module:
        return self.norm(self.config.rms_norm_eps, jnp.dtype(self.config.dtype), name=name)

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        h = self._norm("input_layernorm")(x)
        h, pools = self.mixer()(h, pools, meta)
        if self.sandwich_norms:
            h = self._norm("post_attention_layernorm")(h)
        x = x + h
        h = self._norm("pre_feedforward_layernorm" if self.sandwich_norms else "post_attention_layernorm")(x)
        h = self.mlp()(h)
        if self.sandwich_norms:
            h = self._norm("post_feedforward_layernorm")(h)
        return x + h, pools
