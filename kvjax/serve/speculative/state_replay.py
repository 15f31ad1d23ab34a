"""Rolling back recurrent state after a speculative round: restore the state before the round and
replay the accepted tokens.

A KV slot of a rejected draft token is simply freed (``rollback``), but a recurrent layer's state
is one slot per request that the verify forward advanced over all ``k + 1`` tokens of the round
(``[t, d_1, .., d_k]``). When the target keeps ``m < k + 1`` of them (``m - 1`` accepted drafts and
its own next token, which no forward has consumed yet), the state must be the one after ``[t,
d_1, .., d_{m-1}]``. kvjax gets it exactly by

1. **snapshot**: before the round, each running request's state slot is copied out of the pool
   (``[layers, n, *state]`` per tensor; O(requests x state), not O(pool));
2. **restore and replay**: after acceptance, for each request that kept fewer than ``k + 1``
   tokens, its snapshot is written back into its slot (the pool donated, in place) and the target
   runs one more forward over the ``m`` consumed tokens at their positions, continuing from the
   restored state; it writes the same full-attention KV at the same slots (idempotent) and leaves
   the state after exactly the kept tokens. Its sampled token is discarded (the round already chose
   it). A round in which every request kept all ``k + 1`` tokens replays nothing.

SGLang keeps the intermediate state of every draft position during verification instead
(``mamba`` speculative buffers: one state copy per draft token) and picks the accepted one, which
costs ``k + 1`` states per request of memory and no extra forward; kvjax spends one forward over
the kept tokens of the rejecting requests instead and holds one snapshot per request during a
round. The tokens are the same (the target's greedy tokens): only where the time goes differs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.transfers.state_transfer import with_state_arrays

__all__ = ["restore_states", "snapshot_states"]


@jax.jit
def _snapshot(arrays: tuple[jax.Array, ...], slots: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(a[:, slots] for a in arrays)


@functools.partial(jax.jit, donate_argnums=0)
def _restore(arrays: tuple[jax.Array, ...], slots: jax.Array, saved: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(a.at[:, slots].set(s) for a, s in zip(arrays, saved, strict=True))


def snapshot_states(pool: Any, slots: np.ndarray | jax.Array) -> tuple[jax.Array, ...]:
    """Every state tensor of ``pool`` (a ``RecurrentStatePool``) at ``slots`` (int ``[n]``), in the
    storage layout: ``[layers, n, ...]`` per tensor, conv tensors first (the pool is only read)."""
    return _snapshot(pool.arrays(), jnp.asarray(slots, jnp.int32))


def restore_states(
    pool: Any, slots: np.ndarray | jax.Array, saved: tuple[jax.Array, ...], rows: np.ndarray | jax.Array
) -> Any:
    """``pool`` with rows ``rows`` of a :func:`snapshot_states` result written back at ``slots``
    (``slots[i]`` takes row ``rows[i]``); the pool's arrays are donated (in place). Both functions
    also take traced ids: a DP rank runs them on its slice inside its own program
    (``kvjax.dp.rank_state_replay``)."""
    picked = tuple(s[:, jnp.asarray(rows, jnp.int32)] for s in saved)
    return with_state_arrays(pool, _restore(pool.arrays(), jnp.asarray(slots, jnp.int32), picked))
