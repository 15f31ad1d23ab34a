"""Qwen3-Next's multi-token-prediction (MTP) layer as an EAGLE / NEXTN draft (SGLang's
``Qwen3NextForCausalLMMTP``).

Qwen3-Next checkpoints carry the layer under ``mtp.*`` (Transformers' ``Qwen3NextForCausalLM``
ignores those tensors): ``mtp.pre_fc_norm_embedding`` and ``mtp.pre_fc_norm_hidden`` (``(1 + w)``
RMSNorms), ``mtp.fc`` (``[hidden, 2 * hidden]``, no bias), one decoder layer ``mtp.layers.0.*``
(gated full attention, and the family's sparse MoE when the model has experts: SGLang builds the
MTP model with ``full_attention_interval`` 1 and every layer sparse) and ``mtp.norm``. Its embedding
and LM head are the target's (SGLang shares them with the draft worker). The config names the
layer count ``mtp_num_hidden_layers`` (SGLang sets ``num_nextn_predict_layers`` to 1 for this
architecture's draft); kvjax reads either (``kvjax.hf.recurrent``).

A draft step at position ``p`` takes the token there and a hidden state ``h`` (the target's at
``p - 1``, or the draft's own output of the step before: EAGLE's chain)::

    x = fc([pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)])
    x = decoder_layer(x)                  # full attention: writes the draft's KV at p ("kv_draft")
    h' = norm(x)                          # the draft's output hidden state
    logits = lm_head(h')                  # the proposal for p + 1

``h`` is the target's final-normed hidden state (what SGLang's logits processor hands the draft).
The MTP layer has no recurrent state: its only cache is its KV, so the target's recurrent state is
the only state a rejected draft disturbs, and the speculative loop restores and replays it
(``state_replay``). Its layer id in kvjax is the target's ``num_hidden_layers`` (the draft pool's
layer; SGLang numbers it 0 in the draft worker's own pool).

Where kvjax differs: a Qwen3-Next without experts (``num_experts`` 0, as tiny test models are) gets a
dense SwiGLU MLP in the MTP layer, where SGLang's sparse block would have no experts to build.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.pools import CachePools
from kvjax.serve.families.qwen3_next import Qwen3NextDecoderLayer
from kvjax.serve.layers import BatchMetadata, Embedding, Linear, OffsetRMSNorm
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.speculative.draft_head import draft_logits

__all__ = ["QWEN3_NEXT_FAMILY", "Qwen3NextMTPDraft", "mtp_tensor_name"]

QWEN3_NEXT_FAMILY = "qwen3_next"
_PREFIX = "mtp."
_OWN_TOP = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")


class Qwen3NextMTPDraft(nn.Module):
    """``(tokens [T], hidden [T, hidden], draft pools, meta) -> (logits [S, vocab] float32 at
    ``meta.logits_indices``, every token's output hidden state [T, hidden], new pools)``: the same
    call as ``nextn.NextNDraft`` (``eagle_steps`` runs either).

    ``config``: the target's serving config; ``layer_id``: the MTP layer's id (the target's
    ``num_hidden_layers``: the layer of the draft pool ``"kv_draft"``).
    """

    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(
        self, tokens: jax.Array, hidden: jax.Array, pools: CachePools, meta: BatchMetadata
    ) -> tuple[jax.Array, jax.Array, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        eps = c.rms_norm_eps
        embed = Embedding(c.vocab_size, c.hidden_size, dt, name="embed_tokens")
        e = OffsetRMSNorm(eps, dt, name="pre_fc_norm_embedding")(embed(tokens))
        h = OffsetRMSNorm(eps, dt, name="pre_fc_norm_hidden")(hidden.astype(dt))
        x = Linear(c.hidden_size, False, dt, name="fc")(jnp.concatenate([e, h], axis=-1))
        x, pools = Qwen3NextDecoderLayer(c, self.layer_id, name="decoder")(x, pools, meta)
        out = OffsetRMSNorm(eps, dt, name="norm")(x)
        return draft_logits(c, embed, out, meta), out, pools


def mtp_tensor_name(path: tuple[str, ...], name: Any) -> str:
    """The checkpoint tensor of the MTP layer's parameter at ``path`` (not a shared one):
    ``mtp.layers.0.<name>`` for the decoder layer's, ``mtp.<name>`` for the norms and ``fc``;
    ``name``: ``checkpoint.param_name``."""
    if path[0] == "decoder":
        return _PREFIX + "layers.0." + name(path[1:])
    if path[0] not in _OWN_TOP:
        raise ValueError(f"{'/'.join(path)} is not a parameter of the Qwen3-Next MTP layer")
    return _PREFIX + name(path)
