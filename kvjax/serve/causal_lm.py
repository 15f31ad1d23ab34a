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

A vision-language family's language model sets ``multimodal``: ids outside the vocabulary (image
pad values) are clamped before the embedding lookup, and the rows the step's
``MultimodalMetadata`` flags are replaced by image embeddings (``kvjax.serve.multimodal_metadata``).

Hidden states (speculative drafts of the EAGLE kind read them): a model built with
``return_hidden=True`` returns ``(logits, new pools, hidden [T, hidden])``: every token's hidden
state after the final norm (what SGLang's logits processor captures for an EAGLE / MTP draft).
Built also with ``capture_layers`` (EAGLE3's boundaries ``b`` in ``[0, num_hidden_layers]``), the
hidden states returned are instead ``[T, len(capture_layers) * hidden]``: the residual stream
entering layer ``b`` for each ``b`` in order (the output of layer ``b - 1``; ``b =
num_hidden_layers``: the last layer's output before the final norm), as SGLang's models capture
``layers_to_capture`` for an EAGLE3 draft.

Pipeline parallelism: a model built with ``stage=PipelineStage(start, end, num_layers)`` runs only
its layers ``[start, end)`` (global ids, so each layer finds its pool and weights as in the whole
model). The first stage takes the tokens and embeds them, any other stage takes the hidden states
``[T, hidden]`` of the stage before it; every stage but the last returns its hidden states
``[T, hidden]`` (in the weights' dtype), the last one the logits. Its weights are the whole
model's restricted to what it runs (``stage_params``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.pools import CachePools
from kvjax.serve.layers import MLP, BatchMetadata, Embedding, Linear, RMSNorm
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.multimodal_metadata import merge_image_rows, safe_token_ids


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """The layers ``[start, end)`` of a ``num_layers``-layer model one pipeline stage runs
    (``kvjax.plan.sizing.stage_bounds``); ``0 <= start < end <= num_layers``."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(f"a pipeline stage runs layers [start, end) of [0, {self.num_layers}): got {self}")

    @property
    def first(self) -> bool:
        """Whether the stage embeds the tokens (it runs layer 0)."""
        return self.start == 0

    @property
    def last(self) -> bool:
        """Whether the stage runs the final norm and the LM head (it runs the last layer)."""
        return self.end == self.num_layers


def stage_params(params: dict, stage: PipelineStage, names: StackNames, tied_head: bool) -> dict:
    """The weights of ``stage`` out of the whole model's ``params``: its layers, the embedding on
    the first stage (and on the last with a tied head), the final norm and ``lm_head`` on the last."""
    stack = params[names.stack]
    keep = {f"layers_{i}" for i in range(stage.start, stage.end)}
    if stage.first or (stage.last and tied_head):
        keep.add(names.embed)
    if stage.last:
        keep.add(names.norm)
    out: dict = {names.stack: {k: v for k, v in stack.items() if k in keep}}
    if stage.last and "lm_head" in params:
        out["lm_head"] = params["lm_head"]
    return out


@dataclasses.dataclass(frozen=True)
class StackNames:
    """The checkpoint names of the decoder stack, its token embedding and its final norm."""

    stack: str = "model"
    embed: str = "embed_tokens"
    norm: str = "norm"


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (``{names.stack}.*`` in checkpoints).

    Returns the final-normed hidden states of each row's last token, ``[S, hidden]``, or, with
    ``tied_head``, their logits through the embedding (``[S, vocab]``, the weights' dtype); with
    ``return_hidden`` the pair ``(that, every token's final-normed hidden state [T, hidden])``.
    """

    config: ModelConfig
    decoder_layer: type[nn.Module]
    final_norm: type[nn.Module]
    final_norm_eps: float
    names: StackNames
    scale_embedding: bool
    tied_head: bool
    stage: PipelineStage | None = None
    multimodal: bool = False
    return_hidden: bool = False
    capture_layers: tuple[int, ...] = ()

    @nn.compact
    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[Any, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        stage = self.stage or PipelineStage(0, c.num_hidden_layers, c.num_hidden_layers)
        embed = None
        if stage.first or (stage.last and self.tied_head):
            embed = Embedding(c.vocab_size, c.hidden_size, dt, name=self.names.embed)
        if stage.first:
            assert embed is not None
            if self.multimodal:  # pad values never looked up; image rows from the step's part
                x = merge_image_rows(embed(safe_token_ids(tokens, c.vocab_size)), meta)
            else:
                x = embed(tokens)
            if self.scale_embedding:  # Gemma: sqrt(hidden), the scale cast to the weights' dtype
                x = x * jnp.asarray(c.hidden_size**0.5, jnp.float32).astype(x.dtype)
        else:  # the hidden states of the stage before
            x = tokens
        captured: dict[int, jax.Array] = {}
        for i in range(stage.start, stage.end):
            if i in self.capture_layers:
                captured[i] = x
            x, pools = self.decoder_layer(c, i, name=f"layers_{i}")(x, pools, meta)
        if not stage.last:
            return x, pools
        captured[stage.end] = x
        norm = self.final_norm(self.final_norm_eps, dt, name=self.names.norm)
        hidden = None
        if self.return_hidden and self.capture_layers:  # EAGLE3: the boundaries' residual streams
            hidden = jnp.concatenate([captured[b] for b in self.capture_layers], axis=-1)
            x = norm(x[meta.logits_indices])
        elif self.return_hidden:  # every token normed (per token: the rows' values are the same)
            hidden = norm(x)
            x = hidden[meta.logits_indices]
        else:
            x = norm(x[meta.logits_indices])
        head = embed.attend(x) if self.tied_head and embed is not None else x
        return ((head, hidden) if self.return_hidden else head), pools


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
    # Pipeline parallelism: the layers this module runs (module docstring); None: all of them.
    stage: PipelineStage | None = None
    # A vision-language model's language model: image rows merged after the embedding
    # (``kvjax.serve.multimodal_metadata``).
    multimodal: bool = False
    # Also return every token's final-normed hidden state (module docstring).
    return_hidden: bool = False
    # With return_hidden: the boundaries whose residual streams are returned instead (EAGLE3).
    capture_layers: tuple[int, ...] = ()

    @nn.nowrap
    def final_norm_eps(self) -> float:
        """The final norm's epsilon (``rms_norm_eps``)."""
        return self.config.rms_norm_eps

    @nn.nowrap
    def logit_softcap(self) -> float | None:
        """``cap`` of ``cap * tanh(logits / cap)`` on the float32 logits, or None (no cap)."""
        return None

    @nn.compact
    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[Any, ...]:
        c = self.config
        stack = DecoderStack(
            c,
            self.decoder_layer,
            self.final_norm,
            self.final_norm_eps(),
            self.names,
            self.scale_embedding,
            c.tie_word_embeddings,
            self.stage,
            self.multimodal,
            self.return_hidden and (self.stage is None or self.stage.last),
            self.capture_layers,
            name=self.names.stack,
        )
        x, pools = stack(tokens, pools, meta)
        if self.stage is not None and not self.stage.last:
            return x, pools  # hidden states for the next stage
        hidden = None
        if self.return_hidden:
            x, hidden = x
        logits = x if c.tie_word_embeddings else Linear(c.vocab_size, False, jnp.dtype(c.dtype), name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        cap = self.logit_softcap()
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return (logits, pools, hidden) if self.return_hidden else (logits, pools)


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
