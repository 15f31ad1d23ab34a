"""`RankStateCopies`: a DP rank's recurrent-state copies, written into its own slice of the stacked pools.

Under DP attention every rank's recurrent state lives in one ``RecurrentStatePool`` whose arrays
carry a leading rank axis sharded over ``"data"`` (``kvjax.dp.cache``), and the state axis
(channels / heads) sharded over the rank's ``"tp"`` devices. A rank's host objects (its request
table's state-slot allocator, its ``MambaRadixCache``) use the rank's own slot ids: slot ``s`` of
rank ``r`` is ``pools.recurrent.<array>[r, :, s]``. The tree queues state copies (a matched
checkpoint forked into a request's slot, a request's state copied into a new checkpoint); the
rank's ``RecurrentStateExtension`` records them as one pending device update, built here
(``RecurrentStateExtension.copies_update``), so it writes only rank ``r``'s slice:

* one jitted program over the ``("data", "tp")`` mesh, the pool donated (in place). Inside a
  ``shard_map`` with ``"data"`` manual each device sees its rank's pool and runs the pool's own
  ``fork`` on it (per device over ``"tp"`` as in the single-rank sharded cache). The slot ids are
  ``[dp, n]``, sharded over ``"data"`` (replicated over several processes,
  ``kvjax.dp.step.host_sharding``): rank ``r``'s row holds the copies; every other rank's row
  copies slot 0 (the padding slot) onto itself, which leaves its state as it was.
* copies applied in order: consecutive copies go in one ``fork`` while no destination repeats and
  none is read or written by another copy of the group (as ``apply_state_copies``); each group is
  padded to a power of two with ``(0, 0)`` copies, so few programs compile.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.device_updates import DeviceUpdate
from kvjax.dp.layout import DPLayout
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, host_sharding
from kvjax.dp.step import rank_view
from kvjax.pools.cache_pools import CachePools
from kvjax.pools.recurrent import independent_copy_groups

__all__ = ["RankStateCopies", "rank_state_copies"]


class RankStateCopies:
    """Builds each rank's state-copy updates over ``layout`` (module docstring); one compiled
    copy program per group size, shared by the ranks."""

    def __init__(self, layout: DPLayout) -> None:
        self.layout = layout
        names = jax.tree_util.tree_unflatten(layout.rank_pools, range(layout.rank_pools.num_leaves))
        self._rank_def = jax.tree_util.tree_structure(names.recurrent)
        rows = P(DATA_MESH_AXIS)

        def per_rank(state: Any, src: jax.Array, dst: jax.Array) -> Any:
            leaves, stacked_def = jax.tree_util.tree_flatten(state)
            mine = rank_view(leaves, self._rank_def)
            forked = mine.fork(src[0], dst[0])
            return jax.tree_util.tree_unflatten(stacked_def, [x[None] for x in jax.tree_util.tree_leaves(forked)])

        def copy(state: Any, src: jax.Array, dst: jax.Array) -> Any:
            run = jax.shard_map(
                per_rank,
                mesh=layout.mesh,
                in_specs=(rows, rows, rows),
                out_specs=rows,
                axis_names={DATA_MESH_AXIS},
                check_vma=False,
            )
            return run(state, src, dst)

        specs = layout.pool_specs.recurrent
        state_shardings = jax.tree.map(
            lambda s: NamedSharding(layout.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )
        by_rank = host_sharding(layout.mesh)  # replicated when the mesh spans several processes
        self._copy = jax.jit(
            copy, in_shardings=(state_shardings, by_rank, by_rank), out_shardings=state_shardings, donate_argnums=0
        )

    def update(self, rank: int, copies: list[tuple[int, int]]) -> DeviceUpdate:
        """The copies ``(src slot, dst slot)`` (rank ``rank``'s local slot ids), applied in order to
        rank ``rank``'s slice of ``pools.recurrent`` (donated), as a pending device update
        (target ``"recurrent"``, pages: the destination slots). ``ValueError`` (nothing recorded)
        for a rank outside ``[0, dp_size)``."""
        if not 0 <= rank < self.layout.dp_size:
            raise ValueError(f"rank {rank} is not one of the {self.layout.dp_size} DP ranks")
        groups = independent_copy_groups(copies)

        def copy_states(pools: CachePools) -> CachePools:
            state = pools.recurrent
            for src, dst in groups:
                state = self._copy(state, *self._rank_rows(rank, src, dst))
            return pools.replace(recurrent=state)

        destinations = np.asarray([dst for _, dst in copies], np.int64)
        return DeviceUpdate("state fork", "recurrent", destinations, copy_states)

    def _rank_rows(self, rank: int, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[dp, n]`` slot ids: rank ``rank``'s row the group padded with ``(0, 0)`` copies to a
        power of two, the other rows zeros (slot 0 onto itself)."""
        width = 1 << max(len(src) - 1, 0).bit_length()
        rows = np.zeros((2, self.layout.dp_size, width), np.int32)
        rows[0, rank, : len(src)] = src
        rows[1, rank, : len(dst)] = dst
        return rows[0], rows[1]


_BY_LAYOUT: weakref.WeakKeyDictionary[DPLayout, RankStateCopies] = weakref.WeakKeyDictionary()


def rank_state_copies(layout: DPLayout) -> RankStateCopies:
    """The one ``RankStateCopies`` of the DP cache laid out as ``layout``: what every rank's
    ``RecurrentStateExtension`` and host-tier state engine record their copies through (one set of
    compiled copy programs for all of them)."""
    copies = _BY_LAYOUT.get(layout)
    if copies is None:
        copies = _BY_LAYOUT[layout] = RankStateCopies(layout)
    return copies
