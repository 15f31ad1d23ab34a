"""``attend`` for each kind of layer against the kernels it replaces (write with the pool's own
method, then the reference kernel on the same arguments), and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import attend, attend_mla
from kvjax.errors import InvalidSlotError
from kvjax.pools import CachePools, MLAKVPool, SWAKVPool
from kvjax.pools.recurrent import RecurrentStatePool
from pallas_kernels.mla_ragged_paged_attention import mla_ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.attention.batches import HEADS, batch_metadata, mha_pool, qkv


def _reference(pool, layer, q, k, v, loc, table, meta, **options):
    """The old path: write K/V with the pool's method, then the reference kernel."""
    pool = pool.set_kv_buffer(layer, loc, k, v)
    index = pool.layer_index(layer)
    out = ragged_paged_attention_reference(
        q,
        pool.kv_buffer(layer),
        jnp.asarray(meta.kv_lens),
        jnp.asarray(table),
        jnp.asarray(meta.cu_q_lens),
        jnp.asarray(meta.num_seqs),
        k_scale=pool.k_scale[index],
        v_scale=pool.v_scale[index],
        **options,
    )
    return out, pool


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [{}, {"sm_scale": 0.3, "soft_cap": 5.0}, {"sinks": np.linspace(-1, 1, HEADS).astype(np.float32)}],
    ids=["plain", "soft_cap", "sinks"],
)
def test_full_attention_equals_the_kernel(options):
    meta = batch_metadata()
    q, k, v = qkv()
    pools = CachePools(kv=mha_pool())
    step = jax.jit(lambda pools, q, k, v, meta: attend(pools, 1, q, k, v, meta, **options))
    out, new = step(pools, q, k, v, meta)
    want, want_pool = _reference(pools.kv, 1, q, k, v, meta.out_loc, meta.page_indices, meta, **options)
    _close(out, want)
    _close(new.kv.kv[1], want_pool.kv[1])
    _close(new.kv.kv[0], pools.kv.kv[0])  # another layer is untouched


def test_single_pool_sliding_layer_uses_its_window():
    """``disable_hybrid_swa_memory``: a sliding layer in the one full-size pool."""
    meta = batch_metadata()
    q, k, v = qkv(1)
    pools = CachePools(kv=mha_pool())
    out, new = attend(pools, 0, q, k, v, meta, sliding_window=2)
    want, want_pool = _reference(pools.kv, 0, q, k, v, meta.out_loc, meta.page_indices, meta, sliding_window=2)
    _close(out, want)
    _close(new.kv.kv[0], want_pool.kv[0])
    full, _ = attend(pools, 0, q, k, v, meta)
    assert not np.allclose(np.asarray(full), np.asarray(out)), "the window must change the result"


def _hybrid_pools() -> CachePools:
    """Full layers 0 and 2 in a two-layer full pool, sliding layer 1 in a larger SWA pool."""
    pool = SWAKVPool(full=mha_pool(2), swa=mha_pool(1, pages=10), full_layer_ids=(0, 2), swa_layer_ids=(1,))
    return CachePools(swa=pool)


def test_hybrid_swa_layers_pick_their_pool_and_metadata():
    meta = batch_metadata(swa_offset_pages=4)
    q, k, v = qkv(2)
    pools = _hybrid_pools()
    out, new = attend(pools, 1, q, k, v, meta, sliding_window=3, soft_cap=4.0)
    want, want_swa = _reference(
        pools.swa.swa, 0, q, k, v, meta.swa.out_loc, meta.swa.page_indices, meta, sliding_window=3, soft_cap=4.0
    )
    _close(out, want)
    _close(new.swa.swa.kv[0], want_swa.kv[0])
    _close(new.swa.full.kv[0], pools.swa.full.kv[0])  # the full sub-pool is untouched
    # A full layer of the same pool: common slots and table, no window.
    out, new = attend(pools, 2, q, k, v, meta)
    want, want_full = _reference(pools.swa.full, 1, q, k, v, meta.out_loc, meta.page_indices, meta)
    _close(out, want)
    _close(new.swa.full.kv[1], want_full.kv[1])
    _close(new.swa.swa.kv[0], pools.swa.swa.kv[0])


def test_mla_equals_the_latent_kernel():
    meta = batch_metadata()
    rng = np.random.default_rng(3)
    rank, rope = 16, 8
    q_latent = jnp.asarray(rng.standard_normal((8, HEADS, rank)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((8, HEADS, rope)), jnp.float32)
    c_kv = jnp.asarray(rng.standard_normal((8, rank)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((8, rope)), jnp.float32)
    pool = MLAKVPool.create(
        num_pages=8, page_size=4, num_layers=2, kv_lora_rank=rank, qk_rope_head_dim=rope, dtype="float32"
    )
    pools = CachePools(kv=pool)
    out, new = attend(pools, 1, (q_latent, q_rope), c_kv, k_pe, meta, sm_scale=0.2)
    written = pool.set_mla_kv_buffer(1, meta.out_loc, c_kv, k_pe)
    want = mla_ragged_paged_attention_reference(
        q_latent,
        q_rope,
        written.kv_buffer(1),
        *(jnp.asarray(a) for a in (meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs)),
        sm_scale=0.2,
        kv_scale=written.scale[1],
    )
    _close(out, want)
    _close(new.kv.kv[1], written.kv[1])
    same, _ = attend_mla(pools, 1, q_latent, q_rope, c_kv, k_pe, meta, sm_scale=0.2)
    _close(same, out)
    with pytest.raises(ValueError, match="MLA layer: pass q=\\(q_latent"):
        attend(pools, 1, q_latent, c_kv, k_pe, meta, sm_scale=0.2)
    with pytest.raises(ValueError, match="sm_scale"):
        attend(pools, 1, (q_latent, q_rope), c_kv, k_pe, meta)


def test_a_layer_in_no_pool_is_named_with_the_pools_layers():
    meta = batch_metadata()
    q, k, v = qkv()
    pools = CachePools(kv=mha_pool(2))
    with pytest.raises(InvalidSlotError, match=r"layer_id=5 is in no attention pool \(layers per pool: kv: \[0, 1\]\)"):
        attend(pools, 5, q, k, v, meta)
    hybrid = _hybrid_pools()
    with pytest.raises(InvalidSlotError, match=r"swa: \[0, 1, 2\]"):
        attend(hybrid, 3, q, k, v, meta)
    with pytest.raises(ValueError, match="layer 1 is a sliding-window layer.*pass its sliding_window"):
        attend(hybrid, 1, q, k, v, batch_metadata(swa_offset_pages=4))
    with pytest.raises(ValueError, match="AttentionMetadata.swa"):
        attend(hybrid, 1, q, k, v, meta, sliding_window=3)
    state = RecurrentStatePool.create(
        num_slots=2, layer_ids=(1,), conv_state_shapes=((4, 2),), ssm_state_shape=(1, 2, 2), conv_dtype="float32"
    )
    mixed = CachePools(kv=mha_pool(1, layer_ids=(0,)), recurrent=state)
    with pytest.raises(InvalidSlotError, match="layer_id=1 is a recurrent layer.*recurrent_step"):
        attend(mixed, 1, q, k, v, meta)
