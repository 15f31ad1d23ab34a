"""The smallest pools of a model's kinds and the matching metadata part: what a family's
``trace_state`` returns, to trace the model's weights (``kvjax.serve.model.trace_inputs``).

Each builder returns ``(CachePools, part)``: one page (or one state slot) per pool kind the
model's layers use, and the ``AttentionMetadata`` part those layers read (``SWAMetadata``,
``StateMetadata``), or None when full attention needs nothing beyond the common fields. Weights
traced on these pools do not depend on any cache the model is later served with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from kvjax.attention import KindMetadata, StateMetadata, SWAMetadata
from kvjax.pools import CachePools, MHAKVPool, SWAKVPool
from kvjax.serve.model_config import ModelConfig

__all__ = ["mha_trace_state", "recurrent_trace_state", "swa_trace_state"]

TraceState = tuple[CachePools, KindMetadata | None]


def _one_page_mha_pool(config: ModelConfig, num_layers: int, layer_ids: tuple[int, ...] | None = None) -> MHAKVPool:
    """An MHA pool of one page of one token for ``num_layers`` layers of the model's KV heads,
    head dim and dtype; ``layer_ids``: their global ids when they are not ``0..num_layers-1``."""
    return MHAKVPool.create(
        num_pages=1,
        page_size=1,
        num_layers=num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=config.dtype,
        layer_ids=layer_ids,
    )


def mha_trace_state(config: ModelConfig) -> TraceState:
    """A one-page MHA pool of the model's shape and no part (the default ``Family.trace_state``)."""
    return CachePools(kv=_one_page_mha_pool(config, config.num_hidden_layers)), None


def swa_trace_state(config: ModelConfig, sliding: Sequence[bool]) -> TraceState:
    """One-page full and SWA pools of the model's shape (``sliding``: per layer, whether it is a
    sliding-window layer), and the sliding layers' one-token ``SWAMetadata``."""
    full_ids = tuple(i for i, s in enumerate(sliding) if not s)
    swa_ids = tuple(i for i, s in enumerate(sliding) if s)
    pool = SWAKVPool(
        full=_one_page_mha_pool(config, len(full_ids)) if full_ids else None,
        swa=_one_page_mha_pool(config, max(len(swa_ids), 1)),
        full_layer_ids=full_ids,
        swa_layer_ids=swa_ids,
    )
    part = SWAMetadata(out_loc=jnp.zeros((1,), jnp.int32), page_indices=jnp.zeros((1, 1), jnp.int32))
    return CachePools(swa=pool), part


def recurrent_trace_state(
    config: ModelConfig,
    *,
    attention_layers: tuple[int, ...],
    recurrent_layers: tuple[int, ...],
    conv_dim: int,
    conv_kernel: int,
    ssm_state_shape: tuple[int, ...],
) -> TraceState:
    """The smallest pools of a hybrid recurrent model (one page for its attention layers, one state
    slot for its recurrent ones: a ``[conv_dim, conv_kernel - 1]`` conv window in the model's dtype
    and a float32 ``ssm_state_shape`` state) and a one-row batch's ``StateMetadata``."""
    from kvjax.pools.recurrent import RecurrentStatePool

    pools: dict[str, Any] = {}
    if attention_layers:
        pools["kv"] = _one_page_mha_pool(config, len(attention_layers), attention_layers)
    if recurrent_layers:
        pools["recurrent"] = RecurrentStatePool.create(
            num_slots=1,
            layer_ids=recurrent_layers,
            conv_state_shapes=((conv_dim, conv_kernel - 1),),
            ssm_state_shape=ssm_state_shape,
            conv_dtype=config.dtype,
            ssm_dtype="float32",
        )
    part = StateMetadata(
        state_slots=jnp.ones((1,), jnp.int32),
        has_initial_state=jnp.zeros((1,), jnp.int32),
        track_slots=jnp.zeros((1,), jnp.int32),
        track_at=jnp.zeros((1,), jnp.int32),
    )
    return CachePools(pools), part
