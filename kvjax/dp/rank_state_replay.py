"""`RankStateReplay`: a DP rank's recurrent-state snapshot and restore around a speculative round.

On one rank, a round of a recurrent-state target is rolled back by copying the running requests'
state rows out of the pool before the round (``state_replay.snapshot_states``) and writing back
those of the requests that rejected drafts after it (``state_replay.restore_states``), before the
kept tokens are replayed. Under DP attention every rank's state lives in one stacked
``RecurrentStatePool`` (``kvjax.dp.cache``: slot ``s`` of rank ``r`` is ``<array>[r, :, s]``, the
state axis split over the rank's ``"tp"`` devices), and a rank's host objects use its own slot
ids. Both operations here are one jitted program over the ``("data", "tp")`` mesh, a ``shard_map``
with ``"data"`` manual in which each rank runs the single-rank function on its own pool
(``rank_view``), so the copy logic is ``state_replay``'s, once:

* **snapshot** ``(pool, slots [dp, W]) -> saved``: each tensor ``[dp, layers, W, *state]``, split
  as the pool is (``"data"``, then the state axis over ``"tp"``); the pool is only read. Rank
  ``r``'s row holds its ``n`` running requests' slots and is padded with slot 0 (the padding slot)
  to ``W``, the power of two above ``n`` (so its last column always holds slot 0); every other
  rank's row is slot 0 throughout.
* **restore** ``(pool, slots [dp, V], columns [dp, V], saved) -> pool``: ``slots[r, i]`` takes
  column ``columns[r, i]`` of rank ``r``'s ``saved``, the pool donated (in place). Rank ``r``'s
  row holds its ``m`` restores padded to ``V`` (the power of two at or above ``m``) with slot 0
  from the column that holds slot 0's own snapshot; every other rank's row is that too. So a rank
  not restoring, and the padding, write back to the padding slot only, what it held before the
  round: no other slot of any rank changes.

The powers of two bound the compiled programs to a few shapes (as ``kvjax.dp.rank_state``'s
copies). Slot ids are host arrays placed by ``host_sharding`` (replicated over several processes,
each of which runs every rank's scheduler and so builds the same rows).
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.dp.layout import DPLayout
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, host_sharding
from kvjax.dp.step import rank_view
from kvjax.serve.speculative.state_replay import restore_states, snapshot_states

__all__ = ["RankStateReplay", "rank_state_replay"]


def _power_of_two(n: int) -> int:
    """The smallest power of two ``>= max(n, 1)``."""
    return 1 << max(n - 1, 0).bit_length()


class RankStateReplay:
    """Each rank's snapshot and restore over ``layout`` (module docstring); one compiled program
    per padded width, shared by the ranks."""

    def __init__(self, layout: DPLayout) -> None:
        self.layout = layout
        names = jax.tree_util.tree_unflatten(layout.rank_pools, range(layout.rank_pools.num_leaves))
        rank_def = jax.tree_util.tree_structure(names.recurrent)
        rows = P(DATA_MESH_AXIS)
        mesh = layout.mesh

        def snapshot_rank(state: Any, slots: jax.Array) -> tuple[jax.Array, ...]:
            mine = rank_view(jax.tree_util.tree_leaves(state), rank_def)
            return tuple(x[None] for x in snapshot_states(mine, slots[0]))

        def restore_rank(state: Any, slots: jax.Array, columns: jax.Array, saved: tuple[jax.Array, ...]) -> Any:
            leaves, stacked_def = jax.tree_util.tree_flatten(state)
            mine = rank_view(leaves, rank_def)
            restored = restore_states(mine, slots[0], tuple(x[0] for x in saved), columns[0])
            return jax.tree_util.tree_unflatten(stacked_def, [x[None] for x in jax.tree_util.tree_leaves(restored)])

        def snapshot(state: Any, slots: jax.Array) -> tuple[jax.Array, ...]:
            run = jax.shard_map(
                snapshot_rank,
                mesh=mesh,
                in_specs=(rows, rows),
                out_specs=rows,
                axis_names={DATA_MESH_AXIS},  # "tp" stays automatic: the state keeps its head split
                check_vma=False,
            )
            out: tuple[jax.Array, ...] = run(state, slots)
            return out

        def restore(state: Any, slots: jax.Array, columns: jax.Array, saved: tuple[jax.Array, ...]) -> Any:
            run = jax.shard_map(
                restore_rank,
                mesh=mesh,
                in_specs=(rows, rows, rows, rows),
                out_specs=rows,
                axis_names={DATA_MESH_AXIS},
                check_vma=False,
            )
            return run(state, slots, columns, saved)

        specs = layout.pool_specs.recurrent
        state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        # a snapshot ``[dp, layers, W, *state]`` is laid out as the pool's arrays (``arrays()``: conv first)
        saved_shardings = tuple(state_shardings.arrays())
        by_rank = host_sharding(mesh)
        self._snapshot = jax.jit(snapshot, in_shardings=(state_shardings, by_rank), out_shardings=saved_shardings)
        self._restore = jax.jit(
            restore,
            in_shardings=(state_shardings, by_rank, by_rank, saved_shardings),
            out_shardings=state_shardings,
            donate_argnums=0,
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.layout.dp_size:
            raise ValueError(f"rank {rank} is not one of the {self.layout.dp_size} DP ranks")

    def snapshot(self, state: Any, rank: int, slots: np.ndarray) -> tuple[jax.Array, ...]:
        """Rank ``rank``'s state rows at its local ``slots`` (int ``[n]``) out of ``state`` (the
        stacked ``RecurrentStatePool``, only read): per tensor ``[dp, layers, W, *state]``, column
        ``i < n`` of rank ``rank``'s row holding ``slots[i]`` (module docstring). ``ValueError``
        for a rank outside ``[0, dp_size)``."""
        self._check_rank(rank)
        width = _power_of_two(len(slots) + 1)
        rows = np.zeros((self.layout.dp_size, width), np.int32)
        rows[rank, : len(slots)] = slots
        out: tuple[jax.Array, ...] = self._snapshot(state, rows)
        return out

    def restore(
        self, state: Any, rank: int, slots: np.ndarray, saved: tuple[jax.Array, ...], columns: np.ndarray
    ) -> Any:
        """``state`` (donated) with column ``columns[i]`` of rank ``rank``'s row of ``saved`` (a
        :meth:`snapshot` of this rank) written back at its local slot ``slots[i]``; nothing else
        of any rank changes (module docstring). ``ValueError`` (nothing written) for a rank
        outside ``[0, dp_size)`` or ``slots`` and ``columns`` of different lengths."""
        self._check_rank(rank)
        if len(slots) != len(columns):
            raise ValueError(f"{len(slots)} slots to restore from {len(columns)} snapshot columns")
        pad_column = int(saved[0].shape[2]) - 1  # the snapshot's last column holds slot 0 (module docstring)
        width = _power_of_two(len(slots))
        dst = np.zeros((self.layout.dp_size, width), np.int32)
        src = np.full((self.layout.dp_size, width), pad_column, np.int32)
        dst[rank, : len(slots)] = slots
        src[rank, : len(columns)] = columns
        return self._restore(state, dst, src, saved)


_BY_LAYOUT: weakref.WeakKeyDictionary[DPLayout, RankStateReplay] = weakref.WeakKeyDictionary()


def rank_state_replay(layout: DPLayout) -> RankStateReplay:
    """The one ``RankStateReplay`` of the DP cache laid out as ``layout`` (one set of compiled
    programs for every rank's proposer)."""
    replay = _BY_LAYOUT.get(layout)
    if replay is None:
        replay = _BY_LAYOUT[layout] = RankStateReplay(layout)
    return replay
