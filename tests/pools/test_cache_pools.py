"""`CachePools`: any set of named pools, one pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kvjax.pools import CachePools, MHAKVPool


def small_pool() -> MHAKVPool:
    return MHAKVPool.create(num_pages=2, page_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")


def test_holds_any_named_pools_and_keeps_kv_access():
    kv = small_pool()
    state = jnp.zeros((3, 2))
    pools = CachePools(kv=kv, ssm_state=state)
    assert pools.kv is kv and pools["ssm_state"] is state and pools.names == ("kv", "ssm_state")
    assert "kv" in pools and len(pools) == 2
    with pytest.raises(AttributeError, match="no pool 'kv_swa'"):
        _ = pools.kv_swa
    with pytest.raises(AttributeError, match="immutable"):
        pools.kv = kv


def test_is_a_pytree_and_replace_returns_a_new_object():
    pools = CachePools(kv=small_pool(), ssm_state=jnp.ones((2,)))
    leaves, tree = jax.tree_util.tree_flatten(pools)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.names == pools.names
    doubled = jax.jit(lambda p: p.replace(ssm_state=p.ssm_state * 2))(pools)
    assert float(doubled.ssm_state.sum()) == 4.0 and float(pools.ssm_state.sum()) == 2.0
    with pytest.raises(ValueError, match="no pools"):
        pools.replace(other=1)
    assert pools.nbytes() == sum(leaf.nbytes for leaf in leaves)
