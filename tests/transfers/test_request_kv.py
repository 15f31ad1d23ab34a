"""The pool kinds' ``RequestKV`` movers (``kvjax.transfers.request_kv``) on one device: a request's
rows gathered from one pool and scattered into another of a different page size land unchanged;
an MHA pool holding each KV head twice (TP above the KV heads) gives each head once and takes it
back into both copies; fp8 scales travel; the writes are in place (the pool's old buffers are
donated); the sliding-window pair moves its full side whole and its window side from
``window_start``; the recurrent slot moves every layer at once, lane-dense storage included; and the
errors name the offending value."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.errors import InvalidSlotError
from kvjax.pools.mha import MHAKVPool
from kvjax.pools.mla import MLAKVPool
from kvjax.pools.recurrent import RecurrentStatePool
from kvjax.pools.swa import SWAKVPool
from kvjax.transfers.request_kv import PagedRequestKV, RecurrentRequestKV, RequestSpan, SWARequestKV

LAYERS = 2
HEADS = 2
DIM = 8


def _mha(page_size: int, heads: int = HEADS, pages: int = 8, seed: int | None = None, **kw) -> MHAKVPool:
    pool = MHAKVPool.create(
        num_pages=pages, page_size=page_size, num_layers=LAYERS, num_kv_heads=heads, head_dim=DIM, dtype="float32", **kw
    )
    if seed is None:
        return pool
    rng = np.random.default_rng(seed)
    return pool.replace(kv=tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in pool.kv))


def _rows(pool, slots) -> np.ndarray:
    """``[layers, n, C, D]``: the pool's rows at token ``slots``, read on the host."""
    return np.stack([np.asarray(a).reshape(-1, *a.shape[2:])[np.asarray(slots)] for a in pool.layer_arrays])


def _span(start: int, slots, **kw) -> RequestSpan:
    """Tokens ``[start, start + len(slots))`` at ``slots`` (page 0 is the trash page: writes there
    are dropped, so the tests' slots start past it)."""
    slots = np.asarray(slots, np.int32)
    return RequestSpan(start, start + len(slots), slots, **kw)


def test_rows_move_between_page_sizes_and_only_the_span_changes():
    mover = PagedRequestKV()
    src = _mha(page_size=1, pages=32, seed=0)
    here = np.asarray([5, 9, 3, 17, 12, 20], np.int32)
    there = np.asarray([8, 9, 10, 11, 12, 13], np.int32)  # two pages of 4, the second half used
    pieces = mover.gather(src, _span(0, here), HEADS)
    assert [p.shape for p in mover.pieces(src, _span(0, here), HEADS)] == [tuple(pieces[0].shape), (LAYERS,), (LAYERS,)]
    np.testing.assert_array_equal(np.asarray(pieces[0]), _rows(src, here))
    dst = _mha(page_size=4, pages=8)
    before = [np.asarray(a) for a in dst.kv]
    out = mover.scatter(dst, pieces, _span(0, there), HEADS)
    np.testing.assert_array_equal(_rows(out, there), _rows(src, here))
    rest = np.setdiff1d(np.arange(9 * 4), there)
    for layer, old in zip(out.kv, before, strict=True):
        np.testing.assert_array_equal(
            np.asarray(layer).reshape(-1, 2 * HEADS, DIM)[rest], old.reshape(-1, 2 * HEADS, DIM)[rest]
        )


def test_mha_heads_held_twice_move_once_and_come_back_to_both_copies():
    mover = PagedRequestKV()
    # 2 KV heads held twice each (as at tp 4): the combined axis is [head, copy, K/V]
    rng = np.random.default_rng(1)
    pool = _mha(page_size=4, heads=2 * HEADS)
    once = rng.standard_normal((LAYERS, 9 * 4, HEADS, 1, 2, DIM)).astype(np.float32)
    twice = np.broadcast_to(once, (LAYERS, 9 * 4, HEADS, 2, 2, DIM)).reshape(LAYERS, 9, 4, 4 * HEADS, DIM)
    pool = pool.replace(kv=tuple(jnp.asarray(a) for a in twice))
    slots = np.asarray([4, 5, 6, 13], np.int32)
    (rows, *_) = mover.gather(pool, _span(0, slots), HEADS)
    assert rows.shape == (LAYERS, 4, 2 * HEADS, DIM)
    np.testing.assert_array_equal(np.asarray(rows), once[:, slots].reshape(LAYERS, 4, 2 * HEADS, DIM))
    # into a pool holding each head once (replicas 2 -> 1) ...
    single = mover.scatter(
        _mha(page_size=2, pages=16), mover.gather(pool, _span(0, slots), HEADS), _span(0, [2, 3, 7, 8]), HEADS
    )
    np.testing.assert_array_equal(_rows(single, [2, 3, 7, 8]), np.asarray(rows))
    # ... and back into one holding each twice (1 -> 2): both copies of each head written
    back = mover.scatter(_mha(page_size=4, heads=2 * HEADS), (rows, *_), _span(0, [4, 5, 6, 7]), HEADS)
    np.testing.assert_array_equal(_rows(back, [4, 5, 6, 7]), twice.reshape(LAYERS, -1, 4 * HEADS, DIM)[:, slots])


def test_fp8_rows_and_scales_move():
    mover = PagedRequestKV()
    src = MHAKVPool.create(
        num_pages=8, page_size=4, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="fp8_e4m3"
    )
    k = jnp.asarray(np.random.default_rng(2).standard_normal((4, HEADS, DIM)), jnp.float32)
    src = src.set_kv_scale(0, 0.5, 2.0).set_kv_buffer(0, jnp.asarray([4, 5, 6, 7], jnp.int32), k, -k)
    specs = mover.pieces(src, _span(0, [4, 5, 6, 7]), HEADS)
    assert [s.name for s in specs] == ["rows", "k_scale", "v_scale"]
    assert specs[0].dtype == str(src.kv[0].dtype)
    dst = MHAKVPool.create(
        num_pages=4, page_size=8, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="fp8_e4m3"
    )
    out = mover.scatter(dst, mover.gather(src, _span(0, [4, 5, 6, 7]), HEADS), _span(0, [8, 9, 10, 11]), HEADS)
    np.testing.assert_array_equal(np.asarray(out.k_scale), [0.5, 1.0])
    np.testing.assert_array_equal(np.asarray(out.v_scale), [2.0, 1.0])
    np.testing.assert_array_equal(_rows(out, [8, 9, 10, 11]), _rows(src, [4, 5, 6, 7]))
    assert np.abs(_rows(out, [8, 9, 10, 11]).astype(np.float32)).sum() > 0


def test_mla_latent_rows_move():
    mover = PagedRequestKV()
    src = MLAKVPool.create(
        num_pages=8, page_size=1, num_layers=LAYERS, kv_lora_rank=16, qk_rope_head_dim=8, dtype="float32"
    )
    rng = np.random.default_rng(3)
    src = src.replace(kv=tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in src.kv))
    spec = mover.pieces(src, _span(0, [1, 2, 3]), 1)[0]
    assert spec.head_axis is None and spec.token_axis == 1
    dst = MLAKVPool.create(
        num_pages=2, page_size=4, num_layers=LAYERS, kv_lora_rank=16, qk_rope_head_dim=8, dtype="float32"
    )
    out = mover.scatter(dst, mover.gather(src, _span(0, [3, 1, 2]), 1), _span(0, [5, 6, 7]), 1)
    np.testing.assert_array_equal(_rows(out, [5, 6, 7]), _rows(src, [3, 1, 2]))


def _donated(old: list[jax.Array]) -> bool:
    return all(a.is_deleted() for a in old)


def test_paged_write_is_in_place():
    mover = PagedRequestKV()
    src = _mha(page_size=1, pages=16, seed=4)
    pieces = mover.gather(src, _span(0, [1, 2, 3]), HEADS)
    dst = _mha(page_size=4, pages=8)
    old = list(dst.kv)
    out = mover.scatter(dst, pieces, _span(0, [4, 5, 6]), HEADS)
    assert _donated(old), "the pool's layers were copied, not written in place"
    assert not any(a.is_deleted() for a in src.kv), "gather only reads"
    np.testing.assert_array_equal(_rows(out, [4, 5, 6]), _rows(src, [1, 2, 3]))


def _recurrent(seed: int | None = None, **kw) -> RecurrentStatePool:
    pool = RecurrentStatePool.create(
        num_slots=4,
        layer_ids=(0, 2, 3),
        conv_state_shapes=((6, 3), (4, 3)),
        ssm_state_shape=(2, 4, 4),
        conv_dtype="bfloat16",
        ssm_dtype="float32",
        **kw,
    )
    if seed is None:
        return pool
    rng = np.random.default_rng(seed)
    return pool.replace(
        conv=tuple(jnp.asarray(rng.integers(0, 1 << 14, a.shape), a.dtype) for a in pool.conv),
        ssm=jnp.asarray(rng.standard_normal(pool.ssm.shape), pool.ssm.dtype),
    )


def _states(pool: RecurrentStatePool, slot: int) -> list[np.ndarray]:
    out = []
    for layer in pool.layer_ids:
        conv, ssm = pool.get_states(layer, jnp.asarray([slot], jnp.int32))
        out.append([np.asarray(x.astype(jnp.float32)) for x in (*conv, ssm)])
    return [np.stack(t) for t in zip(*out, strict=True)]


@pytest.mark.parametrize(("lane_src", "lane_dst"), [(False, False), (True, False), (False, True)])
def test_recurrent_slot_moves_every_layer_in_place(lane_src, lane_dst):
    mover = RecurrentRequestKV()
    src = _recurrent(seed=5, lane_dense=lane_src)
    span = _span(0, [1, 2], state_slot=2)
    specs = mover.pieces(src, span, 1)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        ("conv.0", (3, 1, 6, 3), "bfloat16"),
        ("conv.1", (3, 1, 4, 3), "bfloat16"),
        ("ssm", (3, 1, 2, 4, 4), "float32"),
    ]
    pieces = mover.gather(src, span, 1)
    assert [tuple(p.shape) for p in pieces] == [s.shape for s in specs]
    dst = _recurrent(lane_dense=lane_dst)
    old = list(dst.arrays())
    out = mover.scatter(dst, pieces, _span(0, [7, 8], state_slot=3), 1)
    assert _donated(old), "the state pool was copied, not written in place"
    for got, want in zip(_states(out, 3), _states(src, 2), strict=True):
        np.testing.assert_array_equal(got, want)
    for slot in (0, 1, 2, 4):  # every other slot untouched
        assert all(not np.any(a) for a in _states(out, slot))


def test_recurrent_layout_names_the_tp_split():
    assert RecurrentRequestKV().layout(_recurrent()) == ("recurrent state split over tp=1",)


def test_sliding_window_pair_moves_the_window_from_window_start():
    mover = SWARequestKV()

    def pair(page_size: int, seed: int | None = None) -> SWAKVPool:
        return SWAKVPool(
            full=_mha(page_size, pages=8, seed=seed, layer_ids=(1, 3)),
            swa=_mha(page_size, pages=8, seed=None if seed is None else seed + 1, layer_ids=(0, 2)),
            full_layer_ids=(1, 3),
            swa_layer_ids=(0, 2),
        )

    src = pair(1, seed=6)
    span = _span(0, [1, 2, 3, 4, 5, 6], window_start=3, swa_slots=np.asarray([7, 8, 2], np.int32))
    specs = mover.pieces(src, span, HEADS)
    assert [(s.name, s.shape[1], s.window) for s in specs if s.token_axis is not None] == [
        ("full.rows", 6, False),
        ("swa.rows", 3, True),
    ]
    dst = pair(4)
    to = _span(0, [9, 10, 11, 12, 13, 14], window_start=3, swa_slots=np.asarray([4, 5, 6], np.int32))
    out = mover.scatter(dst, mover.gather(src, span, HEADS), to, HEADS)
    np.testing.assert_array_equal(_rows(out.full, to.slots), _rows(src.full, span.slots))
    np.testing.assert_array_equal(_rows(out.swa, [4, 5, 6]), _rows(src.swa, [7, 8, 2]))


def test_errors_name_the_offending_value():
    paged, recurrent = PagedRequestKV(), RecurrentRequestKV()
    with pytest.raises(ValueError, match=r"3 slots for the 2 tokens"):
        RequestSpan(0, 2, np.asarray([1, 2, 3], np.int32))
    with pytest.raises(ValueError, match=r"\[5, 2\) are not a range"):
        RequestSpan(5, 2, np.zeros(0, np.int32))
    with pytest.raises(ValueError, match=r"holds 3 KV heads, not a multiple of the model's 2"):
        paged.gather(_mha(page_size=1, heads=3), _span(0, [1]), 2)
    with pytest.raises(ValueError, match="swa_slots"):
        PagedRequestKV(window=True).gather(_mha(page_size=1), _span(0, [1]), HEADS)
    pool = _recurrent(seed=7)
    with pytest.raises(ValueError, match="no recurrent-state slot"):
        recurrent.gather(pool, _span(0, [1]), 1)
    with pytest.raises(InvalidSlotError, match=r"state slot 9 is outside \[1, 4\]"):
        recurrent.gather(pool, _span(0, [1], state_slot=9), 1)
    pieces = list(recurrent.gather(pool, _span(0, [1], state_slot=1), 1))
    with pytest.raises(ValueError, match=r"'ssm' has shape \(3, 1, 2, 4\); expected \(3, 1, 2, 4, 4\)"):
        recurrent.scatter(pool, [*pieces[:-1], pieces[-1][..., 0]], _span(0, [1], state_slot=2), 1)
    with pytest.raises(ValueError, match="2 recurrent-state pieces given; this pool takes 3"):
        recurrent.scatter(pool, pieces[:2], _span(0, [1], state_slot=2), 1)


def test_cache_movers_move_the_draft_models_pool_with_the_targets():
    """A speculative cache's ``kv_draft`` (a draft of 1 KV head beside a target of 2) moves with
    ``kv``, each pool's rows at the other cache's slots, each with its own heads."""
    import dataclasses

    from kvjax import CacheConfig, ModelSpec, build_kv_cache
    from kvjax.disaggregation.kv_transfer import CacheMovers

    spec = ModelSpec.preset("tiny")
    draft = dataclasses.replace(
        spec, name="tiny-draft", num_hidden_layers=1, layer_kinds=spec.layer_kinds[:1], num_kv_heads=1
    )

    def cache(page_size: int) -> Any:
        config = CacheConfig(
            page_size=page_size,
            context_length=64,
            max_total_tokens=128,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=2,
            speculative_num_draft_tokens=3,
        )
        return build_kv_cache(spec, config, draft_spec=draft)

    src, dst = cache(1), cache(4)
    rng = np.random.default_rng(8)
    noise = {
        n: tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in src.pools[n].kv)
        for n in ("kv", "kv_draft")
    }
    src_pools = src.pools.replace(**{n: src.pools[n].replace(kv=v) for n, v in noise.items()})
    movers = CacheMovers(src)
    assert {m.name: m.kv_heads for m in movers.movers} == {"kv": 2, "kv_draft": 1}
    assert movers.signature() == CacheMovers(dst).signature()
    here, there = _span(0, [3, 9, 4, 11, 12]), _span(0, [8, 9, 10, 11, 12])
    out = CacheMovers(dst).scatter(dst.pools, movers.gather(src_pools, here), there)
    for name in ("kv", "kv_draft"):
        np.testing.assert_array_equal(_rows(out[name], there.slots), _rows(src_pools[name], here.slots), err_msg=name)


def test_dsa_indexer_keys_move_with_their_scales_between_page_sizes():
    """The DSA indexer pool's pages hold their tokens' fp8 keys, then the keys' scales: a token's
    row is gathered from both and written back into both, at another page size."""
    from kvjax.pools.dsa_indexer import DSAIndexerKeyPool

    mover = PagedRequestKV()
    src = DSAIndexerKeyPool.create(num_pages=8, page_size=4, num_layers=LAYERS, index_head_dim=128)
    keys = jnp.asarray(np.random.default_rng(11).standard_normal((LAYERS, 3, 128)), jnp.float32)
    for layer in range(LAYERS):
        src = src.set_index_k(layer, jnp.asarray([5, 6, 9], jnp.int32), keys[layer])
    (spec,) = mover.pieces(src, _span(0, [5, 6, 9]), 1)
    assert (spec.shape, spec.dtype, spec.head_axis) == ((LAYERS, 3, 128 + 4), "uint8", None)
    dst = DSAIndexerKeyPool.create(num_pages=16, page_size=1, num_layers=LAYERS, index_head_dim=128)
    old = list(dst.index_k)
    out = mover.scatter(dst, mover.gather(src, _span(0, [5, 6, 9]), 1), _span(0, [3, 1, 12]), 1)
    assert _donated(old)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(
            np.asarray(out.get_index_k(layer, jnp.asarray([3, 1, 12], jnp.int32))),
            np.asarray(src.get_index_k(layer, jnp.asarray([5, 6, 9], jnp.int32))),
        )
    assert np.abs(np.asarray(out.get_index_k(0, jnp.asarray([3], jnp.int32))) - np.asarray(keys[0, :1])).max() < 0.2
