"""The token-by-token recurrence of a recurrent mixer (Mamba2, gated delta net) over a batch's
sequence rows, through the recurrent-state pool ``pools.recurrent``.

Inputs per sequence row (``BatchMetadata.extras``, from ``RecurrentStateExtension``):
``state_slots [S]`` (the row's state slot, 0 for padding) and ``has_initial_state [S]`` (0: the
sequence starts here, from zero state; 1: continue from the slot: a chunk continuation, a decode
step, or a checkpoint forked at the match); ``track_slots [S]`` and ``track_at [S]``: the state
after the row's ``track_at``-th token of this step (its last page boundary, with the extra buffer)
is written to its ping-pong slot ``track_slots`` too (0 / 0: nothing tracked; such rows write
their zero track state to the padding slot 0).

``recurrent_scan`` reads the rows' conv windows ``[S, conv_dim, K - 1]`` and states (float32,
zero where a row starts its sequence), runs the batch's tokens one at a time (``lax.scan``: a
per-token recurrence, fine on CPU; the chunked form is a kernel's job) and writes the rows' final
states back into their slots. Each token's conv window is its row's last ``K - 1`` conv inputs and
its own; the mixer's ``update`` turns the window, the row's state and the token's own inputs into
the new state and the token's output. Padding tokens (past the last sequence) change nothing.
``recurrent_trace_state`` builds the smallest pools of such a hybrid model (for tracing weights).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.pools import CachePools, MHAKVPool
from kvjax.serve.layers import BatchMetadata
from kvjax.serve.model_config import ModelConfig

__all__ = ["StateUpdate", "recurrent_scan", "recurrent_trace_state"]

StateUpdate = Callable[..., tuple[jax.Array, jax.Array]]
"""``update(window [conv_dim, K] f32, state f32, *token_inputs) -> (new state, output)``."""

_Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # conv, state, tracked conv, tracked state


def recurrent_scan(
    pools: CachePools,
    meta: BatchMetadata,
    layer_id: int,
    conv_input: jax.Array,
    token_inputs: Sequence[jax.Array],
    update: StateUpdate,
) -> tuple[jax.Array, CachePools]:
    """Run layer ``layer_id``'s recurrence over the batch (module docstring).

    ``conv_input``: ``[T, conv_dim]``, each token's input to the causal conv; ``token_inputs``:
    arrays ``[T, ...]`` whose rows are passed to ``update`` after the window and the state (the
    pool's state ``[S, ...]`` has four axes: ``[S, heads, a, b]``). Returns the outputs
    ``[T, ...]`` stacked over the tokens and the pools with ``pools.recurrent`` updated (the rows'
    final states and tracked states written).
    """
    state = pools.recurrent
    slots = meta.extras["state_slots"]
    keep = meta.extras["has_initial_state"].astype(bool)
    (conv0,), ssm0 = state.get_states(layer_id, slots)  # [S, conv_dim, K-1], [S, heads, a, b]
    conv0 = jnp.where(keep[:, None, None], conv0.astype(jnp.float32), 0.0)
    ssm0 = jnp.where(keep[:, None, None, None], ssm0.astype(jnp.float32), 0.0)
    # The sequence row of each token; padding tokens (past the last sequence) change nothing.
    pos = jnp.arange(conv_input.shape[0], dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(meta.cu_q_lens[1:], pos, side="right"), 0, slots.shape[0] - 1)
    live = pos < meta.cu_q_lens[meta.num_seqs[0]]
    # After its track_at-th token of this step a row's state is also kept (a page-aligned
    # checkpoint candidate), written to its track slot after the scan.
    track = live & (pos - meta.cu_q_lens[seq] + 1 == meta.extras["track_at"][seq])

    def token(carry: _Carry, inp: tuple[Any, ...]) -> tuple[_Carry, jax.Array]:
        conv, ssm, conv_kept, ssm_kept = carry
        x_t, s, ok, keep_t, rest = inp
        window = jnp.concatenate([conv[s], x_t.astype(jnp.float32)[:, None]], axis=-1)  # [conv_dim, K]
        st, out = update(window, ssm[s], *rest)
        conv = jnp.where(ok, conv.at[s].set(window[:, 1:]), conv)
        ssm = jnp.where(ok, ssm.at[s].set(st), ssm)
        conv_kept = jnp.where(keep_t, conv_kept.at[s].set(window[:, 1:]), conv_kept)
        ssm_kept = jnp.where(keep_t, ssm_kept.at[s].set(st), ssm_kept)
        return (conv, ssm, conv_kept, ssm_kept), out

    carry: _Carry = (conv0, ssm0, jnp.zeros_like(conv0), jnp.zeros_like(ssm0))
    xs = (conv_input, seq, live, track, tuple(token_inputs))
    (conv1, ssm1, conv_kept, ssm_kept), outputs = jax.lax.scan(token, carry, xs)
    state = state.set_states(layer_id, slots, (conv1,), ssm1)
    state = state.set_states(layer_id, meta.extras["track_slots"], (conv_kept,), ssm_kept)
    return outputs, pools.replace(recurrent=state)


def recurrent_trace_state(
    config: ModelConfig,
    *,
    attention_layers: tuple[int, ...],
    recurrent_layers: tuple[int, ...],
    conv_dim: int,
    conv_kernel: int,
    ssm_state_shape: tuple[int, ...],
) -> tuple[CachePools, dict[str, Any]]:
    """The smallest pools of a hybrid recurrent model (one page for its attention layers, one state
    slot for its recurrent ones: a ``[conv_dim, conv_kernel - 1]`` conv window in the model's dtype
    and a float32 ``ssm_state_shape`` state) and a one-row batch's extras."""
    from kvjax.pools.recurrent import RecurrentStatePool

    pools: dict[str, Any] = {}
    if attention_layers:
        pools["kv"] = MHAKVPool.create(
            num_pages=1,
            page_size=1,
            num_layers=len(attention_layers),
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=config.dtype,
            layer_ids=attention_layers,
        )
    if recurrent_layers:
        pools["recurrent"] = RecurrentStatePool.create(
            num_slots=1,
            layer_ids=recurrent_layers,
            conv_state_shapes=((conv_dim, conv_kernel - 1),),
            ssm_state_shape=ssm_state_shape,
            conv_dtype=config.dtype,
            ssm_dtype="float32",
        )
    extras = {
        "state_slots": jnp.ones((1,), jnp.int32),
        "has_initial_state": jnp.zeros((1,), jnp.int32),
        "track_slots": jnp.zeros((1,), jnp.int32),
        "track_at": jnp.zeros((1,), jnp.int32),
    }
    return CachePools(pools), extras
