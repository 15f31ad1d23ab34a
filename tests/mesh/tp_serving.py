"""What the tensor-parallel parity tests share: the mesh of ``tp`` CPU devices and the check that
a scheduler's pools and weights really are laid out over it."""

from __future__ import annotations

from typing import Any

import jax


def mesh_of(tp: int) -> jax.sharding.Mesh:
    """A ``"tp"`` mesh of the first ``tp`` CPU devices."""
    return jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])


def assert_sharded(sched: Any, tp: int) -> None:
    """The pools and the weights really are laid out over the tp devices."""
    assert sched.mesh is not None and sched.mesh.shape["tp"] == tp
    leaves = jax.tree_util.tree_leaves_with_path(sched.cache.pools)
    off = [jax.tree_util.keystr(p) for p, a in leaves if len(a.sharding.device_set) != tp]
    assert not off, f"pool arrays not on the mesh's {tp} devices: {off}"
    weights = jax.tree.leaves(sched.params)
    assert any(not a.sharding.is_fully_replicated for a in weights), "some weights should be split over tp"
