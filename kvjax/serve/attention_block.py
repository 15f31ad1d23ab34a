"""The q/k/v and output projections every served GQA attention shares, in Hugging Face's names.

``project_qkv_heads`` creates the ``q_proj``, ``k_proj`` and ``v_proj`` linear layers and reshapes
their outputs to heads; ``project_output`` creates ``o_proj``. Both must be called from inside a
``@nn.compact`` method: the layers are created as children of the calling module, so a
checkpoint's ``model.layers.3.self_attn.q_proj.weight`` lands at the same parameter path as if the
module had created them itself (``kvjax.serve.checkpoint``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.serve.layers import Linear
from kvjax.serve.model_config import ModelConfig


def project_qkv_heads(
    config: ModelConfig, x: jax.Array, *, use_bias: bool | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x [T, hidden]`` -> ``(q [T, heads, head_dim], k [T, kv_heads, head_dim], v [T, kv_heads,
    head_dim])`` through ``q_proj``, ``k_proj``, ``v_proj`` in ``config.dtype``.

    ``use_bias``: the projections' bias, ``config.qkv_bias`` when None.
    """
    c = config
    dt = jnp.dtype(c.dtype)
    bias = c.qkv_bias if use_bias is None else use_bias
    t = x.shape[0]
    q = Linear(c.num_attention_heads * c.head_dim, bias, dt, name="q_proj")(x)
    k = Linear(c.num_kv_heads * c.head_dim, bias, dt, name="k_proj")(x)
    v = Linear(c.num_kv_heads * c.head_dim, bias, dt, name="v_proj")(x)
    return (
        q.reshape(t, c.num_attention_heads, c.head_dim),
        k.reshape(t, c.num_kv_heads, c.head_dim),
        v.reshape(t, c.num_kv_heads, c.head_dim),
    )


def project_output(config: ModelConfig, out: jax.Array, *, use_bias: bool | None = None) -> jax.Array:
    """``out [T, heads, head_dim]`` (or ``[T, heads * head_dim]``) -> ``[T, hidden]`` through
    ``o_proj`` in ``config.dtype``. ``use_bias``: ``config.o_bias`` when None."""
    c = config
    bias = c.o_bias if use_bias is None else use_bias
    return Linear(c.hidden_size, bias, jnp.dtype(c.dtype), name="o_proj")(out.reshape(out.shape[0], -1))
