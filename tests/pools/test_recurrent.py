"""The recurrent-state pool: zero, fork and step writes, in place under donation, bounds."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.alloc.state_slots import StateSlotAllocator
from kvjax.errors import InvalidSlotError
from kvjax.pools.recurrent import RecurrentStatePool, fork_live_slots

LAYERS = (0, 1, 3)  # layer 2 is an attention layer


def make_pool(num_slots: int = 6) -> RecurrentStatePool:
    return RecurrentStatePool.create(
        num_slots=num_slots,
        layer_ids=LAYERS,
        conv_state_shapes=((4, 3), (2, 3)),
        ssm_state_shape=(2, 4, 4),
        conv_dtype="bfloat16",
        ssm_dtype="float32",
    )


def filled(pool: RecurrentStatePool, seed: int = 0) -> RecurrentStatePool:
    """Every slot of every layer gets distinct random values (bf16 conv as its bit pattern)."""
    rng = np.random.default_rng(seed)
    conv = tuple(jnp.asarray(rng.integers(-50, 50, a.shape), jnp.bfloat16).view(a.dtype) for a in pool.conv)
    ssm = jnp.asarray(rng.standard_normal(pool.ssm.shape), jnp.float32)
    return dataclasses.replace(pool, conv=conv, ssm=ssm)


def snapshot(pool: RecurrentStatePool) -> list[np.ndarray]:
    return [np.array(a) for a in pool.arrays()]


def test_layout_dtypes_and_padding_slot():
    pool = make_pool()
    assert [a.shape for a in pool.conv] == [(3, 7, 4, 3), (3, 7, 2, 3)]
    assert pool.ssm.shape == (3, 7, 2, 4, 4)
    assert pool.conv[0].dtype == np.uint16, "bf16 is stored as its bit pattern on CPU"
    assert pool.ssm.dtype == np.float32
    assert pool.num_slots == 6 and pool.layer_index(3) == 2
    with pytest.raises(ValueError, match="layer_id=2 not in recurrent layers"):
        pool.layer_index(2)
    conv, ssm = pool.get_states(1, [0])
    assert conv[0].dtype == jnp.bfloat16 and ssm.dtype == jnp.float32


def test_set_and_get_states_round_trip_in_their_dtypes():
    pool = make_pool()
    conv = [jnp.full((2, 4, 3), 1.5), jnp.full((2, 2, 3), -2.0)]
    ssm = jnp.arange(2 * 32, dtype=jnp.float32).reshape(2, 2, 4, 4) / 7
    pool = pool.set_states(3, np.array([2, 5]), conv, ssm)
    got_conv, got_ssm = pool.get_states(3, np.array([5, 2, 1]))
    np.testing.assert_array_equal(np.asarray(got_conv[0][:2], np.float32), 1.5)
    np.testing.assert_array_equal(np.asarray(got_conv[1][:2], np.float32), -2.0)
    np.testing.assert_array_equal(got_ssm[0], ssm[1])
    np.testing.assert_array_equal(got_ssm[2], 0)
    other_conv, other_ssm = pool.get_states(0, np.array([2, 5]))
    assert not np.asarray(other_ssm).any(), "only the named layer is written"


def test_fork_copies_every_layer_and_tensor_and_zero_clears():
    pool = filled(make_pool())
    before = snapshot(pool)
    pool = pool.fork(np.array([1, 4]), np.array([3, 6]))
    after = snapshot(pool)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a[:, 3], b[:, 1])
        np.testing.assert_array_equal(a[:, 6], b[:, 4])
        keep = [0, 1, 2, 4, 5]
        np.testing.assert_array_equal(a[:, keep], b[:, keep])
    pool = pool.zero_slots(np.array([3]))
    for b, a in zip(after, snapshot(pool), strict=True):
        assert not a[:, 3].any()
        np.testing.assert_array_equal(a[:, [0, 1, 2, 4, 5, 6]], b[:, [0, 1, 2, 4, 5, 6]])


@pytest.mark.parametrize("op", ["fork", "zero", "write"])
def test_updates_are_in_place_under_donation(op):
    pool = filled(make_pool())
    fns = {
        "fork": jax.jit(lambda p, s, d: p.fork(s, d), donate_argnums=0),
        "zero": jax.jit(lambda p, s: p.zero_slots(s), donate_argnums=0),
        "write": jax.jit(
            lambda p, s: p.set_states(1, s, [jnp.ones((1, 4, 3)), jnp.ones((1, 2, 3))], jnp.ones((1, 2, 4, 4))),
            donate_argnums=0,
        ),
    }
    args = {"fork": (np.array([2]), np.array([5])), "zero": (np.array([2]),), "write": (np.array([2]),)}[op]
    old = pool.arrays()
    pointers = [a.unsafe_buffer_pointer() for a in old]
    new = fns[op](pool, *args)
    assert all(a.is_deleted() for a in old), "the donated arrays must be consumed"
    assert [a.unsafe_buffer_pointer() for a in new.arrays()] == pointers, "the update must reuse the buffers"


def test_bad_slots_rejected_on_the_host_pool_unchanged():
    pool = filled(make_pool())
    before = snapshot(pool)
    with pytest.raises(InvalidSlotError, match=r"\[7\]"):
        pool.fork(np.array([1]), np.array([7]))
    with pytest.raises(InvalidSlotError, match="state slot"):
        pool.fork(np.array([0]), np.array([3]))
    with pytest.raises(InvalidSlotError, match="also in src"):
        pool.fork(np.array([2, 3]), np.array([3, 4]))
    with pytest.raises(InvalidSlotError):
        pool.zero_slots(np.array([0]))
    with pytest.raises(InvalidSlotError, match="outside"):
        pool.set_states(0, np.array([9]), [jnp.ones((1, 4, 3)), jnp.ones((1, 2, 3))], jnp.ones((1, 2, 4, 4)))
    for b, a in zip(before, snapshot(pool), strict=True):
        np.testing.assert_array_equal(a, b)


def test_traced_out_of_range_write_goes_to_the_padding_slot_never_a_live_one():
    pool = filled(make_pool())
    before = snapshot(pool)
    write = jax.jit(
        lambda p, s: p.set_states(
            0, s, [jnp.full((1, 4, 3), 9.0), jnp.full((1, 2, 3), 9.0)], jnp.full((1, 2, 4, 4), 9.0)
        )
    )
    after = snapshot(write(pool, np.array([1000])))
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a[:, 1:], b[:, 1:]), "the last slot (where clamping would land) is untouched"


def test_fork_from_or_into_a_free_slot_is_refused_by_the_allocator():
    pool = filled(make_pool())
    alloc = StateSlotAllocator(6)
    live = alloc.alloc(2)  # slots 1, 2
    before = snapshot(pool)
    with pytest.raises(InvalidSlotError, match=r"\[3\].*free"):
        fork_live_slots(pool, alloc, np.array([1]), np.array([3]))
    with pytest.raises(InvalidSlotError, match=r"\[5\].*free"):
        fork_live_slots(pool, alloc, np.array([5]), np.array([2]))
    for b, a in zip(before, snapshot(pool), strict=True):
        np.testing.assert_array_equal(a, b)
    assert alloc.available_size() == 4
    pool = fork_live_slots(pool, alloc, live[:1], live[1:])
    np.testing.assert_array_equal(np.asarray(pool.ssm[:, 2]), before[-1][:, 1])


def test_registry_builds_one_pool_from_the_planned_tensors():
    from kvjax.layout.recurrent import RecurrentLayout
    from kvjax.pools.registry import BuildContext, create_pool_group
    from kvjax.spec import RecurrentStateSpec

    layout = RecurrentLayout.per_rank(
        RecurrentStateSpec(
            conv_state_shapes=((8, 3),), conv_dtype="bfloat16", ssm_state_shape=(2, 4, 4), ssm_dtype="float32"
        ),
        1,
    )
    plans = layout.pool_plans(num_slots=5, layer_ids=(0, 2), built=True)
    pool = create_pool_group("recurrent", plans, BuildContext(platform="cpu"))
    assert isinstance(pool, RecurrentStatePool)
    assert pool.nbytes() == sum(p.nbytes for p in plans)
    assert pool.layer_ids == (0, 2) and pool.num_slots == 5


def test_apply_state_copies_equals_copies_one_by_one():
    from kvjax.pools.recurrent import apply_state_copies

    pool = filled(make_pool())
    copies = [(1, 2), (2, 3), (4, 5), (5, 1), (6, 6)]
    want = snapshot(pool)
    for src, dst in copies:
        for a in want:
            a[:, dst] = a[:, src]
    for w, a in zip(want, snapshot(apply_state_copies(pool, copies)), strict=True):
        np.testing.assert_array_equal(a, w)


def test_built_cache_forks_the_matched_checkpoint_into_the_request_slot():
    """The lifecycle with a built cache: a finished request donates its state as a checkpoint;
    the next request's match forks it into the request's own slot (the queued copy applied)."""
    from kvjax import CacheConfig, build_kv_cache
    from kvjax.pools.recurrent import apply_state_copies
    from kvjax.radix import MambaRadixCache
    from kvjax.request import Req
    from tests.specs import F, R, ssm

    config = CacheConfig(max_total_tokens=64, max_running_requests=2, context_length=32, page_size=1)
    cache = build_kv_cache(ssm((R, F)), config.replace(max_mamba_cache_size=4))
    tree, table, kv = cache.tree_cache, cache.req_to_token_pool, cache.allocator
    assert isinstance(tree, MambaRadixCache) and tree.mamba_allocator is table.mamba_allocator
    a = Req("a", [5, 6, 7, 8])
    tree.match_and_lock(a)
    table.alloc_reqs([a])
    table.write(a.req_pool_idx, 0, kv.alloc(4))
    state = cache.pools.recurrent  # "run the model": a's state after 4 tokens
    conv = [jnp.full((1, *s), 3.0) for s in state.conv_state_shapes]
    state = state.set_states(0, [a.mamba_pool_idx], conv, jnp.full((1, *state.ssm_state_shape), 0.25))
    cache.set_pools(cache.pools.replace(recurrent=state))
    tree.cache_finished_req(a)
    table.free_req(a)
    b = Req("b", [5, 6, 7, 8, 9])
    m = tree.match_and_lock(b)
    assert m.prefix_len == 4 and b.mamba_cow_src_index == 1 and b.mamba_pool_idx == 2
    state = apply_state_copies(cache.pools.recurrent, tree.take_state_copies())
    conv_b, ssm_b = state.get_states(0, [b.mamba_pool_idx])
    np.testing.assert_array_equal(np.asarray(ssm_b), 0.25)
    np.testing.assert_array_equal(np.asarray(conv_b[0], np.float32), 3.0)


def test_lane_dense_conv_storage_round_trips_and_forks_in_place():
    """TPU's storage form (on by default there), exercised on CPU: each conv state flat as [rows, 128]."""
    pool = RecurrentStatePool.create(
        num_slots=4,
        layer_ids=(0, 2),
        conv_state_shapes=((40, 3),),  # 120 elements: one padded row
        ssm_state_shape=(2, 4, 4),
        conv_dtype="float32",
        lane_dense=True,
    )
    assert pool.conv[0].shape == (2, 5, 1, 128) and pool.conv_state_shapes == ((40, 3),)
    conv = np.arange(2 * 40 * 3, dtype=np.float32).reshape(2, 40, 3)
    pool = pool.set_states(2, np.array([1, 3]), [jnp.asarray(conv)], jnp.ones((2, 2, 4, 4)))
    (got,), _ = pool.get_states(2, np.array([3, 1]))
    np.testing.assert_array_equal(np.asarray(got), conv[::-1])
    old = pool.conv[0]
    pointer = old.unsafe_buffer_pointer()
    pool = jax.jit(lambda p, s, d: p.fork(s, d), donate_argnums=0)(pool, np.array([1]), np.array([4]))
    assert old.is_deleted() and pool.conv[0].unsafe_buffer_pointer() == pointer
    (got,), _ = pool.get_states(2, np.array([4]))
    np.testing.assert_array_equal(np.asarray(got)[0], conv[0])
