"""What every draft layer that reads the target's hidden states shares (DeepSeek's MTP layer,
Qwen3-Next's MTP layer, the EAGLE head): the logits of its picked rows through the target's head,
and a one-layer trace pool of the target's MHA layout for tracing its weights.

``draft_logits`` runs inside a draft module's compact ``__call__``: the ``lm_head`` it creates
(an untied head) is that module's submodule, named ``lm_head`` as the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.pools import CachePools, MHAKVPool
from kvjax.serve.layers import BatchMetadata, Embedding, Linear
from kvjax.serve.model_config import ModelConfig

__all__ = ["draft_logits", "mha_trace_pools"]


def draft_logits(config: ModelConfig, embed: Embedding, out: jax.Array, meta: BatchMetadata) -> jax.Array:
    """float32 ``[rows, vocab]``: the logits of ``out``'s rows at ``meta.logits_indices``, through
    the tied embedding or an ``lm_head`` of the draft module calling it (the target's weights)."""
    picked = out[meta.logits_indices]
    if config.tie_word_embeddings:
        logits = embed.attend(picked)
    else:
        logits = Linear(config.vocab_size, False, jnp.dtype(config.dtype), name="lm_head")(picked)
    return logits.astype(jnp.float32)


def mha_trace_pools(target: ModelConfig, layer_id: int) -> CachePools:
    """A one-page MHA pool of ``target``'s KV layout holding only layer ``layer_id`` (one slot), to
    trace a draft layer's weights."""
    kv = MHAKVPool.create(
        num_pages=1,
        page_size=1,
        num_layers=1,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        dtype=target.dtype,
        layer_ids=(layer_id,),
    )
    return CachePools(kv=kv)
