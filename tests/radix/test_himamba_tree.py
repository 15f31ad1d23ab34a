"""HiMambaRadixCache (FULL + MAMBA + host) standalone with simulated copy engines, and the state
transfer engine over a real recurrent pool: which checkpoints are copied at backup, what a
demotion frees, the host hit (it ends at a node with a state, on the device or the host), the
all-or-nothing load-back, bad input, and leak-free accounting."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.device_updates import PendingDeviceUpdates
from kvjax.plan.kinds.recurrent import host_state_slots
from kvjax.pools.cache_pools import CachePools
from kvjax.pools.recurrent import RecurrentStatePool
from kvjax.radix import HiRadixCache
from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
from kvjax.radix.storage_link import StorageOptions
from kvjax.tiers.copy_engine import CopyError, TransferStatus
from kvjax.tiers.host_state_pool import HostStatePool
from kvjax.tiers.simulated_copy import SimulatedCopyEngine
from kvjax.tiers.storage import StorageTier
from kvjax.tiers.storage_key import StorageKey
from kvjax.transfers.state_transfer import StateTransferEngine


def tree(states: int = 4, host_states: int = 8) -> tuple[HiMambaRadixCache, SimulatedCopyEngine]:
    eng = SimulatedCopyEngine()
    t = HiMambaRadixCache(
        page_size=1, host_pool_tokens=64, mamba_pool_size=states, host_state_slots=host_states, state_engine=eng
    )
    return t, eng


def state(t: HiMambaRadixCache, eng: SimulatedCopyEngine, label: str) -> int:
    slot = int(t.mamba_allocator.alloc(1)[0])
    eng.device[slot] = label
    return slot


def balanced(t: HiMambaRadixCache) -> bool:
    t.sanity_check()
    m = t.mamba.sizes()
    return (
        t.mamba_allocator.available_size() + m.evictable + m.protected == t.mamba_allocator.size and t.host_balanced()
    )


def test_demote_then_load_back_brings_kv_and_checkpoint_back():
    t, eng = tree()
    s = state(t, eng, "A")
    t.insert(list(range(1, 13)), mamba_value=s)
    assert t.mamba.pending_transfers == 1  # the new leaf's checkpoint is copied with its KV
    t.check_transfers(wait=True)
    assert t.mamba.backups == 1 and t.mamba.landed_host_slot(t.last_insert_node) is not None
    assert t.evict(12) == 12  # demoted: KV and device checkpoint freed, both host copies kept
    assert t.mamba_allocator.available_size() == 4 and t.host_only_states == 1
    assert balanced(t)
    m = t.match_prefix(list(range(1, 14)))
    assert (m.prefix_len, m.host_hit_length) == (0, 12)
    assert m.extras["mamba"].branching_seqlen is None  # no KV past the host checkpoint
    loaded = t.init_load_back(m)
    assert loaded.prefix_len == 12
    new = t.mamba.slot_of(loaded.last_node)
    assert new is not None and eng.device[new] == "A"  # the host copy came back into a new slot
    t.check_transfers(wait=True)
    again = t.match_prefix(list(range(1, 14)))
    assert (again.prefix_len, again.extras["mamba"].slot, again.host_hit_length) == (12, new, 0)
    assert t.mamba.landed_host_slot(loaded.last_node) is not None  # the host copy is kept
    assert balanced(t)


def test_checkpoint_evicted_from_the_device_is_a_host_hit_loaded_alone():
    t, eng = tree()
    a = state(t, eng, "A")
    t.insert(list(range(1, 9)), mamba_value=a)
    t.insert(list(range(1, 13)), mamba_value=state(t, eng, "B"))
    t.check_transfers(wait=True)
    assert t.evict(0, mamba_num=1).mamba_num_evicted == 1  # the older, internal one: a tombstone
    m = t.match_prefix([*range(1, 9), 99])
    assert (m.prefix_len, m.host_hit_length) == (0, 8)  # its KV is on the device, its state on the host
    kv_loads = len(t.host.engine.log)  # type: ignore[attr-defined]
    loaded = t.init_load_back(m)
    assert loaded.prefix_len == 8 and len(t.host.engine.log) == kv_loads  # type: ignore[attr-defined]
    assert eng.device[t.mamba.slot_of(loaded.last_node)] == "A"
    t.check_transfers(wait=True)
    assert balanced(t)


def test_a_host_hit_ends_at_a_node_with_a_state():
    t, eng = tree()
    t.insert([1, 2, 3, 4])  # no checkpoint
    t.insert(list(range(1, 9)), mamba_value=state(t, eng, "A"))
    t.insert(list(range(1, 13)))  # KV past the checkpoint, no state
    t.check_transfers(wait=True)
    t.evict(12)
    m4 = t.match_prefix([1, 2, 3, 4, 99])
    assert m4.host_hit_length == 0 and m4.extras["mamba"].branching_seqlen == 4  # [1..4] has no state anywhere
    m = t.match_prefix(list(range(1, 14)))
    assert m.host_hit_length == 8 and m.extras["mamba"].branching_seqlen == 12  # past the host checkpoint
    t.host.evict_host(4)  # [9..12]'s host KV goes
    assert t.match_prefix(list(range(1, 10))).host_hit_length == 8
    t.host.evict_host(4)  # the host KV of [5..8] goes (and with its node, its state)
    assert t.match_prefix(list(range(1, 10))).host_hit_length == 0
    assert t.mamba.host_slot == {} and balanced(t)


def test_incremental_backup_of_a_checkpoint_given_to_a_backed_up_node():
    t, eng = tree()
    t.insert(list(range(1, 9)))
    t.check_transfers(wait=True)  # KV backed up, no state
    node = t.last_insert_node
    t.insert(list(range(1, 9)), mamba_value=state(t, eng, "A"))
    assert t.mamba.pending_transfers == 1
    t.check_transfers(wait=True)
    assert eng.host[t.mamba.landed_host_slot(node)] == "A"
    assert balanced(t)


def test_a_new_checkpoint_on_a_node_whose_state_is_on_the_host_only():
    t, eng = tree()
    t.insert(list(range(1, 9)), mamba_value=state(t, eng, "A"))
    t.check_transfers(wait=True)
    t.evict(0, mamba_num=1)  # a leaf backed up: demoted, its state on the host only
    assert t.host_only_states == 1
    t.insert(list(range(1, 9)), mamba_value=state(t, eng, "A2"))  # recomputed and cached again
    assert t.host_only_states == 0 and t.mamba.landed_host_slot(t.last_insert_node) is not None
    assert t.match_prefix(list(range(1, 10))).prefix_len == 8
    assert balanced(t)


def test_full_host_state_pool_evicts_host_only_states_then_skips():
    t, eng = tree(states=4, host_states=1)
    t.insert([1, 2, 3], mamba_value=state(t, eng, "A"))
    t.check_transfers(wait=True)
    t.insert([7, 8, 9], mamba_value=state(t, eng, "B"))
    assert t.mamba.skipped_backups == 1  # no free host slot, and A's copy is not evictable (A is on the device)
    t.check_transfers(wait=True)
    t.evict(0, mamba_num=1)  # A's device checkpoint goes: its node is a demoted leaf, its state host-only
    t.insert([4, 5, 6], mamba_value=state(t, eng, "C"))  # takes A's host slot
    t.check_transfers(wait=True)
    assert t.mamba.host_evicted == 1 and t.match_prefix([1, 2, 3, 4]).host_hit_length == 0
    assert balanced(t)


def test_load_back_is_all_or_nothing_when_no_state_slot_can_be_freed():
    t, eng = tree(states=1)
    t.insert(list(range(1, 9)), mamba_value=state(t, eng, "A"))
    t.check_transfers(wait=True)
    t.evict(8)
    held = int(t.mamba_allocator.alloc(1)[0])  # a request holds the only state slot
    m = t.match_prefix(list(range(1, 9)))
    assert t.init_load_back(m) is m  # nothing changed: recompute
    assert t.match_prefix(list(range(1, 9))).host_hit_length == 8 and t.host_only_count == 1
    t.mamba_allocator.free([held])
    assert balanced(t)


def test_bad_input_and_unbuilt_options_are_named():
    t, _ = tree()
    other, _ = tree()
    other.insert([1, 2, 3])
    with pytest.raises(ValueError, match="not a node of this tree"):
        t.load_back(other.last_insert_node)
    with pytest.raises(NotImplementedError, match="write_back"):
        HiMambaRadixCache(host_pool_tokens=64, mamba_pool_size=2, write_policy="write_back")
    # a storage tier without the checkpoints' store (its prefixes could never end at a state)
    key = StorageKey(model="m", page_shape=(1, 1, 2, 8), store_dtype="float32", kv_dtype="float32")
    storage = StorageOptions(StorageTier("memory", key=key), object())  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="needs its recurrent-state checkpoints stored beside"):
        HiMambaRadixCache(host_pool_tokens=64, mamba_pool_size=2, storage=storage)
    assert isinstance(t, HiRadixCache)


def test_reset_frees_everything_with_copies_in_flight():
    t, eng = tree()
    t.insert(list(range(1, 9)), mamba_value=state(t, eng, "A"))
    t.insert([20, 21], mamba_value=state(t, eng, "B"))
    t.reset()
    assert t.mamba_allocator.available_size() == 4
    assert t.host_state_allocator.available_size() == 8 and balanced(t)


def test_host_state_slots_follow_sglangs_sizing():
    assert host_state_slots(10, hicache_ratio=2.0) == 21
    assert host_state_slots(10, hicache_ratio=2.0, hicache_size_gb=1e-6, state_share=0.5, bytes_per_state=100) == 6


def _pool(slots: int = 4) -> RecurrentStatePool:
    return RecurrentStatePool.create(
        num_slots=slots, layer_ids=(0, 2), conv_state_shapes=((3, 2),), ssm_state_shape=(2, 2, 2)
    )


def test_state_engine_round_trips_a_checkpoint_after_the_queued_copy():
    pools = CachePools(recurrent=_pool())
    pending = PendingDeviceUpdates(pools)
    host = HostStatePool(3, 2, tuple((tuple(a.shape[2:]), str(a.dtype)) for a in pools.recurrent.arrays()))
    eng = StateTransferEngine(pending, host)
    conv = (jnp.arange(6, dtype=jnp.float32).reshape(1, 3, 2),)
    ssm = jnp.full((1, 2, 2, 2), 7.0)
    rec = pools.recurrent.set_states(2, np.array([1]), conv, ssm)
    pools = pools.replace(recurrent=rec)
    pending.hand_in(pools)
    eng.record_copies([(1, 2)])  # the tree's queued copy: the backup of slot 2 reads it
    backup = eng.start_backup(np.array([2]), np.array([0]))
    assert eng.poll(backup, wait=True) is TransferStatus.PENDING  # only the owner applies it
    pools = pending.apply(pools)
    assert eng.poll(backup, wait=True) is TransferStatus.DONE
    load = eng.start_load(np.array([0]), np.array([4]))
    pools = pending.apply(pools)
    assert eng.poll(load, wait=True) is TransferStatus.DONE
    got_conv, got_ssm = pools.recurrent.get_states(2, np.array([4]))
    np.testing.assert_array_equal(np.asarray(got_conv[0], np.float32), np.asarray(conv[0]))
    np.testing.assert_array_equal(np.asarray(got_ssm), np.asarray(ssm))
    with pytest.raises(CopyError, match="out of range"):
        eng.start_load(np.array([0]), np.array([9]))
    with pytest.raises(ValueError, match="plan both from the same layout"):
        StateTransferEngine(pending, HostStatePool(3, 1, host.rows))


def _path(t: HiMambaRadixCache, node) -> tuple[int, ...]:
    out: list[int] = []
    while node is not t.root:
        out[:0] = node.token_ids()
        node = node.parent
    return tuple(out)


def _check_labels(t: HiMambaRadixCache, eng: SimulatedCopyEngine) -> None:
    """Every device checkpoint holds its node's state, every landed host copy too."""
    for node in t.nodes():
        if node is t.root:
            continue
        slot = t.mamba.slot_of(node)
        if slot is not None:
            assert eng.device[slot] == _path(t, node), node
        hslot = t.mamba.landed_host_slot(node)
        if hslot is not None:
            assert eng.host[hslot] == _path(t, node), node


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_states_with_their_nodes_and_leak_nothing(seed):
    """Random inserts (with and without a state), matches with load-backs, FULL, state and host
    evictions and polling steps on small pools: after every operation the tree is sane, every
    checkpoint on the device and on the host holds the state of its own prefix (the simulated
    engines move labels), and the device state slots and both host pools balance."""
    rng = np.random.default_rng(seed)
    eng = SimulatedCopyEngine()
    t = HiMambaRadixCache(page_size=1, host_pool_tokens=48, mamba_pool_size=5, host_state_slots=8, state_engine=eng)
    alloc = t.mamba_allocator
    inserted: list[list[int]] = []
    loads = 0
    for _ in range(150):
        key = [int(x) for x in rng.integers(1, 4, size=int(rng.integers(2, 9)))]
        op = rng.integers(0, 6)
        if op == 2 and inserted:  # mostly a prefix inserted before, with a token more
            key = [*inserted[int(rng.integers(0, len(inserted)))], 9]
        if op <= 1:
            inserted.append(key)
            slot = None
            if rng.random() < 0.7 and alloc.available_size():
                slot = int(alloc.alloc(1)[0])
                eng.device[slot] = tuple(key)
            r = t.insert(key, mamba_value=slot)
            if slot is not None and r.mamba_exist:
                alloc.free([slot])
        elif op == 2:
            m = t.match_prefix(key)
            loaded = t.init_load_back(m)
            if loaded is not m:
                assert loaded.prefix_len == m.prefix_len + m.host_hit_length
                loads += 1
        elif op == 3:
            t.evict(int(rng.integers(1, 6)))
        elif op == 4:
            t.evict(0, mamba_num=int(rng.integers(1, 3)))
        else:
            t.check_transfers(wait=bool(rng.integers(0, 2)))
        t.sanity_check()
        _check_labels(t, eng)
        assert balanced(t)
    assert loads >= 3 and t.mamba.host_evicted > 0, (loads, t.mamba.host_evicted)
    t.check_transfers(wait=True)
    t.reset()
    assert alloc.available_size() == alloc.size and balanced(t)
    assert t.host_state_allocator.available_size() == 8


def test_write_through_selective_backs_the_checkpoint_up_with_its_node_at_the_second_hit():
    eng = SimulatedCopyEngine()
    t = HiMambaRadixCache(
        host_pool_tokens=64, mamba_pool_size=4, state_engine=eng, write_policy="write_through_selective"
    )
    t.insert(list(range(1, 9)), mamba_value=state(t, eng, "A"))
    assert t.mamba.pending_transfers == 0 and t.host.pending_backups == 0  # one hit: nothing yet
    slot = state(t, eng, "A again")
    assert t.insert(list(range(1, 9)), mamba_value=slot).mamba_exist  # the node keeps its own state
    t.mamba_allocator.free([slot])
    assert t.mamba.pending_transfers == 1 and t.host.pending_backups == 1  # KV and state together
    t.check_transfers(wait=True)
    assert eng.host[t.mamba.landed_host_slot(t.last_insert_node)] == "A" and balanced(t)


def test_retained_checkpoints_are_evicted_last_on_the_device_and_the_host():
    t, eng = tree(host_states=2)
    t.insert([1, 2, 3], mamba_value=state(t, eng, "A"), retention_seconds=100.0)
    kept = t.last_insert_node
    t.insert([4, 5, 6], mamba_value=state(t, eng, "B"))
    t.check_transfers(wait=True)
    t.evict(0, mamba_num=1)  # B's, though A's is older: A is retained
    assert t.mamba.slot_of(kept) is not None and t.host_only_states == 1
    t.evict(0, mamba_num=1)  # now A's: both host-only
    t.insert([7, 8, 9], mamba_value=state(t, eng, "C"))  # its backup evicts B's host copy, not A's
    assert t.mamba.landed_host_slot(kept) is not None and t.mamba.host_evicted == 1
    assert balanced(t)


def test_a_state_copy_that_cannot_start_leaves_the_kv_loaded_and_leaks_nothing():
    t, eng = tree()
    t.insert(list(range(1, 13)), mamba_value=state(t, eng, "A"))
    t.check_transfers(wait=True)
    t.evict(12)
    m = t.match_prefix(list(range(1, 13)))
    eng.fail_loads = 1  # the state engine refuses the next load
    assert t.init_load_back(m) is m
    t.check_transfers(wait=True)
    assert t.host_only_count == 0 and t.host_only_states == 1  # the KV came back, the state did not
    assert t.mamba_allocator.available_size() == 4  # the state slot taken for it went back
    again = t.match_prefix(list(range(1, 13)))
    assert (again.prefix_len, again.host_hit_length) == (0, 12)  # a later load brings the state
    assert t.init_load_back(again).prefix_len == 12 and eng.device[t.mamba.slot_of(again.last_host_node)] == "A"
    t.check_transfers(wait=True)
    assert balanced(t)
