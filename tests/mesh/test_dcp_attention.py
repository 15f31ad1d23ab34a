"""DCP attention alone: each rank's partial attention over its stripe, merged by log-sum-exp,
equals attention over the whole sequence on one device.

A batch of three sequences (a prefill, a chunk continuing earlier tokens, a decode) over striped
pages of ``PAGE * dcp`` slots is served twice: on one device by ``paged_attention`` over a plain
pool of pages of ``PAGE * dcp`` tokens (the reference), and by DCP:

* stacked: the reference pool's rows split by rank (``kvjax.alloc.dcp``), each rank's partial
  attention (the ragged paged attention kernel over the rank's rows with its log-sum-exp: its
  jnp reference, and the Pallas kernel under the HLO interpreter) computed on one device and
  merged with ``merge_stacked``;
* over a ``("tp", "dcp")`` mesh of the TP group's devices (DCP divides it): ``paged_attention`` on
  a pool striped over ``"dcp"`` with its KV heads over ``"tp"`` and the query heads over both
  axes, which writes each token on its owner only, gathers the query heads over ``"dcp"`` and
  merges with collectives, each device keeping its own heads.

Both match the reference within float32 rounding, and every device of the mesh holds exactly its
rank's rows; so does one KV head at tp 4 x dcp 2, replicated over the ``"tp"`` ranks as TP would
and striped over the DCP ranks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.alloc.dcp import DCPStripe
from kvjax.attention import build_attention_metadata
from kvjax.attention.dcp_attention import striped_partial_attention
from kvjax.attention.dcp_merge import merge_stacked
from kvjax.attention.paged_attention import paged_attention
from kvjax.attention.sharding import serving_mesh
from kvjax.pools import MHAKVPool

PAGE = 2  # rows per rank and page
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
MAX_SEQS = 4
PAGES = 12
# (tokens already cached, new tokens) per sequence: a prefill, a chunk after earlier tokens, a decode.
SEQS = ((0, 11), (9, 3), (13, 1))
OPTIONS = {
    "window": {"sliding_window": 5},
    "soft_cap_and_sinks": {"soft_cap": 2.0, "sinks": np.array([0.5, -1.0, 2.0, 0.0], np.float32)},
}


def _slots(dcp: int) -> list[np.ndarray]:
    """Each sequence's slots of positions ``0 .. total - 1``: its own striped pages, in order."""
    big = PAGE * dcp
    out, next_page = [], 1
    for cached, new in SEQS:
        total = cached + new
        pages = np.arange(next_page, next_page + -(-total // big))
        next_page += len(pages)
        pos = np.arange(total)
        out.append(pages[pos // big] * big + pos % big)
    return out


def _batches(dcp: int) -> list[tuple[np.ndarray, object]]:
    """Two steps: every sequence's cached tokens, then the new ones (metadata over striped pages)."""
    big = PAGE * dcp
    slots = _slots(dcp)
    width = max(-(-(c + n) // big) for c, n in SEQS)
    table = np.zeros((MAX_SEQS, width), np.int32)
    for i, s in enumerate(slots):
        pages = np.unique(s // big)
        table[i, : len(pages)] = pages
    steps = []
    for first in (True, False):
        rows = [i for i, (c, _) in enumerate(SEQS) if c > 0] if first else list(range(len(SEQS)))
        spans = [(0, SEQS[i][0]) if first else (SEQS[i][0], SEQS[i][0] + SEQS[i][1]) for i in rows]
        _, meta = build_attention_metadata(
            tokens=[np.arange(a, b) for a, b in spans],
            starts=[a for a, _ in spans],
            slots=np.concatenate([slots[i][a:b] for i, (a, b) in zip(rows, spans, strict=True)]).astype(np.int32),
            page_table=table[rows],
            max_seqs=MAX_SEQS,
        )
        steps.append((np.asarray(rows), meta))
    return steps


def _qkv(tokens: int, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (tokens, HEADS, HEAD_DIM), jnp.float32)
    k = jax.random.normal(keys[1], (tokens, KV_HEADS, HEAD_DIM), jnp.float32)
    v = jax.random.normal(keys[2], (tokens, KV_HEADS, HEAD_DIM), jnp.float32)
    return q, k, v


def _reference(dcp: int, options: dict) -> tuple[list[jax.Array], MHAKVPool]:
    pool = MHAKVPool.create(
        num_pages=PAGES, page_size=PAGE * dcp, num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32"
    )
    outs = []
    attend = _jitted(options)
    for step, (_, meta) in enumerate(_batches(dcp)):
        q, k, v = _qkv(len(meta.positions), step)
        out, pool = attend(pool, q, k, v, meta)
        outs.append(out)
    return outs, pool


def _jitted(options: dict) -> Any:
    """``paged_attention`` of layer 0 with ``options``, jitted (one compile instead of eager ops)."""
    return jax.jit(lambda pool, q, k, v, meta: paged_attention(pool, 0, q, k, v, meta, **options))


@pytest.mark.parametrize("interpret", [None, True], ids=["reference", "kernel"])
@pytest.mark.parametrize(("dcp", "name"), [(2, "window"), (4, "soft_cap_and_sinks")])
def test_stacked_partials_merge_to_whole_sequence_attention(dcp, name, interpret):
    options = OPTIONS[name]
    outs, pool = _reference(dcp, options)
    _, meta = _batches(dcp)[1]
    q, _, _ = _qkv(len(meta.positions), 1)
    layer = pool.kv_buffer(0)
    n, big, combined, dim = layer.shape
    by_rank = layer.reshape(n, PAGE, dcp, combined, dim)  # slot offset m * dcp + r -> [m, r]
    partial = jax.jit(striped_partial_attention, static_argnames=("dcp", "sliding_window", "soft_cap", "interpret"))
    partials = [
        partial(
            q,
            by_rank[:, :, r],
            jnp.asarray(meta.kv_lens),
            jnp.asarray(meta.page_indices),
            jnp.asarray(meta.cu_q_lens),
            jnp.asarray(meta.num_seqs),
            rank=r,
            dcp=dcp,
            sliding_window=options.get("sliding_window"),
            soft_cap=options.get("soft_cap"),
            interpret=interpret,
        )
        for r in range(dcp)
    ]
    sinks = options.get("sinks")
    merged = merge_stacked(
        jnp.stack([o for o, _ in partials]),
        jnp.stack([lse for _, lse in partials]),
        sinks=None if sinks is None else jnp.asarray(sinks),
    )
    np.testing.assert_allclose(np.asarray(merged), np.asarray(outs[1]), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("tp", "dcp"), [(4, 4), (4, 2)])
def test_striped_pool_over_a_mesh_matches_one_device(tp, dcp):
    options = OPTIONS["soft_cap_and_sinks"] if dcp == 2 else OPTIONS["window"]
    outs, pool = _reference(dcp, options)
    mesh = serving_mesh(jax.make_mesh((tp // dcp, dcp), ("tp", "dcp"), devices=jax.devices()[:tp]))
    striped = MHAKVPool.create(
        num_pages=PAGES,
        page_size=PAGE * dcp,
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="float32",
        mesh=mesh,
        context_axis="dcp",
    )
    attend = _jitted(options)
    for step, (_, meta) in enumerate(_batches(dcp)):
        q, k, v = _qkv(len(meta.positions), step)
        out, striped = attend(striped, q, k, v, meta)
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[step]), atol=2e-6, rtol=1e-5)
    # Device of rank r holds rows r * PAGE ... of every page: the reference's slots with offset % dcp == r.
    want = np.asarray(pool.kv_buffer(0))
    got = np.asarray(striped.kv_buffer(0))
    stripe = DCPStripe(PAGE, dcp)
    live = np.concatenate(_slots(dcp))
    flat_want = want.reshape(-1, *want.shape[2:])
    flat_got = got.reshape(-1, *got.shape[2:])
    np.testing.assert_array_equal(flat_got[stripe.global_row(live)], flat_want[live])
    shard = striped.kv[0].addressable_shards[0]
    assert shard.data.shape[1] == PAGE, "each device holds its rank's rows of every page"
    assert shard.data.shape[2] == 2 * KV_HEADS // (tp // dcp), "and its tp rank's KV heads"
    assert len(striped.kv[0].sharding.device_set) == tp, "the TP group's devices, no more"


def test_kv_heads_fewer_than_the_tp_ranks_are_replicated_and_still_striped(monkeypatch):
    """One KV head at tp 4 x dcp 2: the head is stored on both ``"tp"`` ranks (the pool's head axis
    holds 2 copies), each rank's copy striped over its 2 DCP ranks, and the output is one device's."""
    monkeypatch.setitem(globals(), "KV_HEADS", 1)  # the batches' K/V and the reference pool: one head
    tp, dcp = 4, 2
    options = OPTIONS["soft_cap_and_sinks"]
    outs, _ = _reference(dcp, options)
    mesh = serving_mesh(jax.make_mesh((tp // dcp, dcp), ("tp", "dcp"), devices=jax.devices()[:tp]))
    striped = MHAKVPool.create(
        num_pages=PAGES,
        page_size=PAGE * dcp,
        num_layers=1,
        num_kv_heads=tp // dcp,  # the one head, once per "tp" rank
        head_dim=HEAD_DIM,
        dtype="float32",
        mesh=mesh,
        context_axis="dcp",
    )
    attend = _jitted(options)
    for step, (_, meta) in enumerate(_batches(dcp)):
        q, k, v = _qkv(len(meta.positions), step)
        out, striped = attend(striped, q, k, v, meta)
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[step]), atol=2e-6, rtol=1e-5)
    assert {shard.data.shape[1:3] for shard in striped.kv[0].addressable_shards} == {(PAGE, 2)}
