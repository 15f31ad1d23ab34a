"""Device state changes only where the caller sees it (``docs/architecture.md``, "Device state: who
changes it").

A user's own loop threads its pools through its own donated jitted step, as the owner of the step
(apply the pending updates, run the step, hand the result in). Between its steps it calls kvjax's
tree, host tier, retraction backup and recurrent-state extension: a host tier loads a prefix back,
a retracted request's KV is restored and a checkpoint's state is forked. After every kvjax call
``cache.pools`` is still the user's pools and none of the user's arrays is deleted; the tokens the
user's step computes from the loaded and restored KV equal those of a run that recomputes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import CacheConfig, build_kv_cache
from kvjax.radix import HiRadixCache
from kvjax.transfers.retraction_backup import RetractionBackup
from tests.caches import host_tier_cache

ROWS = 64  # slots written and read per user step (padded: one compiled shape)
VOCAB = 97


def _value(tokens: np.ndarray) -> np.ndarray:
    """The toy model's key/value entry for a token (exact in float32)."""
    return (np.asarray(tokens) % 31 + 1).astype(np.float32)


def _weights() -> np.ndarray:
    return (np.arange(ROWS) % 7 + 1).astype(np.float32)


def recomputed_token(tokens: list[int]) -> int:
    """The toy model's next token after ``tokens``, computed from scratch (no cache)."""
    return int((_value(np.asarray(tokens)) * _weights()[: len(tokens)]).sum()) % VOCAB


@functools.partial(jax.jit, donate_argnums=0)
def user_step(pools, loc, values, read_slots, read_mask):
    """The user's own step: write ``values`` at ``loc`` (every head and dim, layer 0), then the
    next token from the KV at ``read_slots`` (the request's whole sequence). Pools donated."""
    kv = pools.kv
    entry = jnp.broadcast_to(values[:, None, None], (values.shape[0], kv.num_kv_heads, kv.head_dim))
    kv = kv.set_kv_buffer(0, loc, entry, entry)
    keys, _ = kv.get_kv(0, read_slots)
    total = jnp.sum(jnp.where(read_mask, keys[:, 0, 0], 0.0) * (jnp.arange(ROWS) % 7 + 1))
    return pools.replace(kv=kv), total.astype(jnp.int32) % VOCAB


class UserLoop:
    """A user's serving loop: it owns the step and the pools it threads through it."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.pools = cache.pools
        self.donated: list[jax.Array] = []

    def step(self, write_slots, write_tokens, read_slots) -> int:
        loc = np.zeros(ROWS, np.int32)  # padding writes the trash page
        loc[: len(write_slots)] = write_slots
        values = np.zeros(ROWS, np.float32)
        values[: len(write_tokens)] = _value(np.asarray(write_tokens, np.int64))
        read = np.zeros(ROWS, np.int32)
        read[: len(read_slots)] = read_slots
        mask = np.arange(ROWS) < len(read_slots)
        self.pools = self.cache.apply_pending(self.pools)  # loads, restores, forks land here
        self.donated.append(self.pools.kv.kv[0])
        self.pools, token = user_step(self.pools, jnp.asarray(loc), jnp.asarray(values), jnp.asarray(read), mask)
        self.cache.set_pools(self.pools)  # hand the result in: backups read it
        return int(token)

    def through_kvjax(self, call):
        """Run a kvjax call between steps and check it left the user's device state alone."""
        out = call()
        assert self.cache.pools is self.pools, "a kvjax call swapped the pools behind the owner"
        assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.pools))
        return out


def test_a_users_loop_never_holds_a_donated_or_stale_array_through_load_back_and_restore():
    cache = host_tier_cache(
        page_size=4, max_running_requests=4, hicache_ratio=4.0, disaggregation_decode_retraction_backup="host_pool"
    )
    tree, alloc = cache.tree_cache, cache.allocator
    assert isinstance(tree, HiRadixCache)
    loop = UserLoop(cache)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 256, 24)]

    # A request computes its prompt; the tree caches it (write-through: a backup of the pools the
    # user handed in after the step).
    slots = alloc.alloc(24)
    assert loop.step(slots, prompt, slots) == recomputed_token(prompt)
    loop.through_kvjax(lambda: tree.insert(prompt, slots))
    loop.through_kvjax(lambda: tree.check_transfers(wait=True))
    assert loop.through_kvjax(lambda: tree.evict(24)) == 24  # demoted to the host: device pages freed
    other = alloc.alloc(alloc.available_size())  # other requests overwrite those device pages
    assert np.isin(slots, other).all()
    loop.step(other, [int(t) for t in rng.integers(0, 256, other.size)], other)
    alloc.free(other)

    # The prefix comes back from the host inside a kvjax call: recorded, not swapped in.
    match = loop.through_kvjax(lambda: tree.match_prefix(prompt))
    assert match.prefix_len == 0 and match.host_hit_length == 24
    loaded = loop.through_kvjax(lambda: tree.init_load_back(match))
    assert loaded.prefix_len == 24 and [u.what for u in cache.pending.updates()] == ["host load"]
    assert loop.step([], [], loaded.indices) == recomputed_token(prompt)  # applied by the owner first
    loop.through_kvjax(lambda: tree.check_transfers(wait=True))

    # A retracted request's own KV goes to the host and comes back into fresh pages.
    retraction = RetractionBackup("host_pool", 4, host=tree.host)
    tokens = [int(t) for t in rng.integers(0, 256, 16)]
    own = alloc.alloc(16)
    assert loop.step(own, tokens, own) == recomputed_token(tokens)
    assert loop.through_kvjax(lambda: retraction.backup("q", own, 0, 16))
    alloc.free(own)
    other = alloc.alloc(alloc.available_size())
    assert np.isin(own, other).all()
    loop.step(other, [int(t) for t in rng.integers(0, 256, other.size)], other)
    alloc.free(other)
    fresh = alloc.alloc(16)
    assert loop.through_kvjax(lambda: retraction.restore("q", fresh))
    assert cache.pending.count == 1
    assert loop.step([], [], fresh) == recomputed_token(tokens)
    loop.through_kvjax(lambda: retraction.poll(wait=True))
    assert retraction.restored == 1 and cache.pending.count == 0

    # Every array the user donated was its own step's input, and only those are deleted.
    assert all(a.is_deleted() for a in loop.donated)
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(loop.pools))
    tree.sanity_check()


def test_a_users_loop_sees_a_recurrent_state_fork_only_when_it_applies_it():
    from kvjax.radix import MambaRadixCache
    from kvjax.serve.extension import StepBatch
    from kvjax.serve.recurrent_extension import RecurrentStateExtension
    from kvjax.serve.serving_req import ServingReq
    from tests.specs import F, R, ssm

    config = CacheConfig(max_total_tokens=64, max_running_requests=2, context_length=32, page_size=1)
    cache = build_kv_cache(ssm((R, F)), config.replace(max_mamba_cache_size=4))
    tree, table, kv = cache.tree_cache, cache.req_to_token_pool, cache.allocator
    assert isinstance(tree, MambaRadixCache)
    extension = RecurrentStateExtension(cache)
    pools = cache.pools

    def through_kvjax(call):
        out = call()
        assert cache.pools is pools and not any(x.is_deleted() for x in jax.tree_util.tree_leaves(pools))
        return out

    a = ServingReq("a", [5, 6, 7, 8], max_new_tokens=1)
    through_kvjax(lambda: tree.match_and_lock(a))
    table.alloc_reqs([a])
    table.write(a.req_pool_idx, 0, kv.alloc(4))

    @functools.partial(jax.jit, donate_argnums=0)
    def run_model(pools, slot):  # the user's step: a's state after its 4 tokens
        state = pools.recurrent
        conv = [jnp.full((1, *s), 3.0) for s in state.conv_state_shapes]
        return pools.replace(recurrent=state.set_states(0, slot, conv, jnp.full((1, *state.ssm_state_shape), 0.25)))

    pools = run_model(cache.apply_pending(pools), jnp.asarray([a.mamba_pool_idx]))
    cache.set_pools(pools)
    through_kvjax(lambda: tree.cache_finished_req(a))
    table.free_req(a)
    b = ServingReq("b", [5, 6, 7, 8, 9], max_new_tokens=1)
    through_kvjax(lambda: tree.match_and_lock(b))
    through_kvjax(lambda: extension.after_admit(b))
    assert b.mamba_cow_src_index is not None and b.mamba_pool_idx != b.mamba_cow_src_index
    batch = StepBatch(
        rows=np.asarray([b.req_pool_idx]),
        starts=np.asarray([4]),
        seq_lens=np.asarray([5]),
        slots=np.asarray([0]),
        reqs=[b],
        max_seqs=2,
        is_decode=False,
    )
    through_kvjax(lambda: extension.step_metadata(batch))  # records the fork
    assert [u.what for u in cache.pending.updates()] == ["state fork"]
    pools = cache.apply_pending(pools)  # the owner applies it before its step
    conv_b, ssm_b = pools.recurrent.get_states(0, [b.mamba_pool_idx])
    np.testing.assert_array_equal(np.asarray(ssm_b), 0.25)
    np.testing.assert_array_equal(np.asarray(conv_b[0], np.float32), 3.0)
    assert cache.pools is pools and cache.pending.count == 0
