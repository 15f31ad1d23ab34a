"""The token-by-token recurrence of a recurrent mixer (Mamba2, gated delta net) over a batch's
sequence rows, through the recurrent-state pool ``pools.recurrent``.

Inputs per sequence row: ``meta.state`` (``StateMetadata``): the row's state slot, whether it
continues that state or starts from zero, and the optional tracked state (the state after the
row's ``track_at``-th token of this step, written to ``track_slots`` too: a page-aligned
checkpoint candidate of the extra buffer).

``recurrent_step`` reads the rows' conv windows ``[S, conv_dim, K - 1]`` and states (float32,
zero where a row starts its sequence), runs the batch's tokens one at a time (``lax.scan``: a
per-token recurrence, fine on CPU; the chunked form is a kernel's job) and writes the rows' final
states back into their slots. Each token's conv window is its row's last ``K - 1`` conv inputs and
its own; the mixer's ``update`` turns the window, the row's state and the token's own inputs into
the new state and the token's output. Padding tokens (past the last sequence) change nothing.

Over a mesh the pool holds each rank's heads (``RecurrentStatePool`` shards its state over
``"tp"``: memory ``1 / tp`` per device; under decode context parallelism over ``("tp", "dcp")``
jointly, the whole TP group, as the weights). Two ways to run a mixer there:

* ``recurrent_mixer_over_heads`` (head-parallel, Megatron style, as SGLang runs its recurrent
  layers): the whole mixer, from its column-parallel input projections to its row-parallel output
  projection, runs inside ``jax.shard_map`` on each rank's heads, over that rank's own state
  shard (read and written in place: the shard is the donated pool's), and one ``psum`` of the
  ``[T, hidden]`` partial outputs ends it: one all-reduce per layer, as after attention.
  ``shard_map`` rather than sharding constraints: the recurrence is a ``lax.scan`` with a
  scattered carry, which XLA's partitioner does not split over heads by itself (it gathers the
  state or compiles a much slower program); inside ``shard_map`` every array is the rank's own
  and nothing moves but the final sum.
* ``recurrent_step`` called on the sharded pool outside ``shard_map``: the batch rows' states are
  gathered (replicated) before the scan, the recurrence runs whole on every rank, and the final
  states are written back to their ranks' shards (the gather moves ``S`` rows of state per layer
  per step, not the pool). Correct for any mixer, but every rank computes every head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.attention.metadata import AttentionMetadata
from kvjax.pools import CachePools
from kvjax.pools.recurrent import state_axis_size

__all__ = [
    "LocalMixer",
    "StateUpdate",
    "recurrent_mixer_over_heads",
    "recurrent_step",
    "state_mesh_axis",
    "state_ranks",
]

StateUpdate = Callable[..., tuple[jax.Array, jax.Array]]
"""``update(window [conv_dim, K] f32, state f32, *token_inputs) -> (new state, output)``."""

_Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # conv, state, tracked conv, tracked state


def recurrent_step(
    pools: CachePools,
    layer_id: int,
    conv_input: jax.Array,
    token_inputs: Sequence[jax.Array],
    update: StateUpdate,
    meta: AttentionMetadata,
    *,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, CachePools]:
    """Run layer ``layer_id``'s recurrence over the batch (module docstring).

    Args:
        pools: the cache's pools; ``pools.recurrent`` holds the layer.
        layer_id: the model's layer id (one of ``pools.recurrent.layer_ids``).
        conv_input: ``[T, conv_dim]``: each token's input to the causal conv.
        token_inputs: arrays ``[T, ...]`` whose rows are passed to ``update`` after the window and
            the state.
        update: the mixer's per-token step (``StateUpdate``); the pool's state per row has four
            axes ``[heads, a, b]`` after the row axis.
        meta: the batch's metadata, with ``meta.state`` set.
        mesh: accepted for a uniform signature; the pool's own mesh shards its reads and writes.

    Returns:
        ``(outputs [T, ...] stacked over the tokens, pools with pools.recurrent updated)``: the
        rows' final states and tracked states written.

    Raises:
        ValueError: ``meta.state`` is None.
    """
    del mesh  # the pool's reads and writes follow its own sharding; the scan is partitioned by XLA
    meta = meta.as_device_arrays()
    rows = meta.require_state()
    state = pools.recurrent
    slots = rows.state_slots
    keep = rows.has_initial_state.astype(bool)
    (conv0,), ssm0 = state.get_states(layer_id, slots)  # [S, conv_dim, K-1], [S, heads, a, b]
    if state.mesh is not None:  # the batch rows' states, gathered: the scan runs on every rank
        replicated = NamedSharding(state.mesh, P())
        conv0 = jax.lax.with_sharding_constraint(conv0, replicated)
        ssm0 = jax.lax.with_sharding_constraint(ssm0, replicated)
    conv0 = jnp.where(keep[:, None, None], conv0.astype(jnp.float32), 0.0)
    ssm0 = jnp.where(keep[:, None, None, None], ssm0.astype(jnp.float32), 0.0)
    # The sequence row of each token; padding tokens (past the last sequence) change nothing.
    pos = jnp.arange(conv_input.shape[0], dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(meta.cu_q_lens[1:], pos, side="right"), 0, slots.shape[0] - 1)
    live = pos < meta.cu_q_lens[meta.num_seqs[0]]
    # After its track_at-th token of this step a row's state is also kept (a page-aligned
    # checkpoint candidate), written to its track slot after the scan.
    track = live & (pos - meta.cu_q_lens[seq] + 1 == rows.track_at[seq])

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
    state = state.set_states(layer_id, rows.track_slots, (conv_kept,), ssm_kept)
    return outputs, pools.replace(recurrent=state)


LocalMixer = Callable[[CachePools, jax.Array, Any, AttentionMetadata], tuple[jax.Array, CachePools]]
"""``mixer(pools, x [T, hidden], weights, meta) -> (out [T, hidden], pools)`` on one rank's heads:
``pools`` holds only ``recurrent`` (the rank's state shard, no mesh: ``recurrent_step`` on it runs
locally), ``weights`` are the rank's slices; ``out`` is the rank's partial sum of the output
projection (the caller sums it over the ranks)."""


def state_ranks(pools: CachePools) -> int:
    """How many ranks the recurrent state's heads are split over (1: one device, no mesh)."""
    state = pools.recurrent
    return 1 if state.mesh is None else state_axis_size(state.mesh, state.state_axis)


def state_mesh_axis(pools: CachePools) -> str | tuple[str, ...]:
    """The mesh axis (or axes, jointly) the recurrent state's heads are split over, which the
    mixer's weights are given over too (``"tp"``; ``("tp", "dcp")`` under decode context
    parallelism; ``"tp"`` without a mesh)."""
    axis = pools.recurrent.state_axis
    return "tp" if axis is None else axis


def recurrent_mixer_over_heads(
    pools: CachePools,
    mixer: LocalMixer,
    x: jax.Array,
    weights: Any,
    weight_specs: Any,
    meta: AttentionMetadata,
) -> tuple[jax.Array, CachePools]:
    """Run a recurrent mixer head-parallel over the state's mesh (module docstring).

    Args:
        pools: the cache's pools; ``pools.recurrent`` holds the mixer's layer.
        mixer: the mixer on one rank's heads (``LocalMixer``), written for any rank count: it reads
            its head counts from its weights' (local) shapes.
        x: ``[T, hidden]``, the layer's input (replicated over the ranks).
        weights: the mixer's weights (a pytree), laid out over the mesh as ``weight_specs`` say.
        weight_specs: a ``PartitionSpec`` per leaf of ``weights`` (``kvjax.serve.param_sharding``'s
            rules: heads over the state's axis, the output projection's input columns too).
        meta: the batch's metadata, with ``meta.state`` set (replicated).

    Returns:
        ``(out [T, hidden] summed over the ranks, pools with pools.recurrent updated)``. Without a
        mesh: ``mixer`` on the whole pool and weights, as is.
    """
    state = pools.recurrent
    if state.mesh is None:
        out, local = mixer(CachePools(recurrent=state), x, weights, meta)
        return out, pools.replace(recurrent=local.recurrent)
    axis = state.state_axis
    ranks = state_ranks(pools)
    per_rank_conv = None if state.conv_shapes is None else tuple((s[0] // ranks, *s[1:]) for s in state.conv_shapes)
    state_spec = P(None, None, axis)  # the pool's layout: channels / heads on axis 2
    array_specs = tuple(state_spec for _ in state.arrays())

    def per_rank(arrays: tuple[jax.Array, ...], x: jax.Array, weights: Any, meta: AttentionMetadata) -> tuple[Any, ...]:
        local = state.replace(
            conv=tuple(arrays[:-1]), ssm=arrays[-1], mesh=None, state_axis=None, conv_shapes=per_rank_conv
        )
        partial, new = mixer(CachePools(recurrent=local), x, weights, meta)
        return jax.lax.psum(partial, axis), new.recurrent.arrays()

    run = jax.shard_map(
        per_rank,
        mesh=state.mesh,
        in_specs=(array_specs, P(), weight_specs, P()),
        out_specs=(P(), array_specs),
        check_vma=False,  # the state updates may be Pallas calls, which carry no varying-axes types
    )
    out, arrays = run(state.arrays(), x, weights, meta)
    return out, pools.replace(recurrent=state.replace(conv=tuple(arrays[:-1]), ssm=arrays[-1]))
