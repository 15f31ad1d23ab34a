"""``attend`` over a 2-device mesh equals the single-device result: the kernel runs per device
under ``shard_map`` (query heads and the pool's KV heads split over ``"tp"``), and the pool's
written pages are the same. Run in a subprocess with two host CPU devices (this test process may
have one)."""

from __future__ import annotations

import textwrap

from tests.mesh.subprocess_run import run_with_devices

CHECK = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from kvjax.attention import attend
    from kvjax.pools import CachePools, MHAKVPool, MLAKVPool, SWAKVPool
    from tests.attention.batches import PAGE, POOL_LAYOUT, batch_metadata, qkv

    assert len(jax.devices()) >= 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    q, k, v = qkv(4)
    sinks = jnp.linspace(-1.0, 1.0, q.shape[1], dtype=jnp.float32)

    def pool(layers, on_mesh):
        return MHAKVPool.create(num_pages=10, num_layers=layers, mesh=mesh if on_mesh else None, **POOL_LAYOUT)

    def run(pools, layer, meta, **kw):
        step = jax.jit(lambda pools, q, k, v, meta: attend(pools, layer, q, k, v, meta, **kw))
        return step(pools, q, k, v, meta)

    result = {}
    meta = batch_metadata()
    single = run(CachePools(kv=pool(2, False)), 1, meta, sinks=sinks, soft_cap=6.0)
    sharded = run(CachePools(kv=pool(2, True)), 1, meta, sinks=sinks, soft_cap=6.0)
    result["mha_out"] = bool(np.allclose(single[0], sharded[0], atol=1e-5))
    result["mha_pages"] = bool(np.array_equal(np.asarray(single[1].kv.kv[1]), np.asarray(sharded[1].kv.kv[1])))
    result["mha_spec"] = str(sharded[1].kv.kv[1].sharding.spec)
    jaxpr = jax.make_jaxpr(lambda pools: attend(pools, 1, q, k, v, meta))(CachePools(kv=pool(2, True)))
    result["kernel_per_device"] = str(jaxpr).count("shard_map") >= 2  # the write and the kernel
    # An explicit mesh over pools created without one gives the same result too.
    explicit = run(CachePools(kv=pool(2, False)), 1, meta, sinks=sinks, soft_cap=6.0, mesh=mesh)
    result["explicit_mesh"] = bool(np.allclose(single[0], explicit[0], atol=1e-5))

    def swa(on_mesh):
        return CachePools(swa=SWAKVPool(full=pool(1, on_mesh), swa=pool(1, on_mesh), full_layer_ids=(0,),
                                        swa_layer_ids=(1,)))
    meta = batch_metadata(swa_offset_pages=4)
    single = run(swa(False), 1, meta, sliding_window=3)
    sharded = run(swa(True), 1, meta, sliding_window=3)
    result["swa_out"] = bool(np.allclose(single[0], sharded[0], atol=1e-5))
    result["swa_pages"] = bool(np.array_equal(np.asarray(single[1].swa.swa.kv[0]),
                                              np.asarray(sharded[1].swa.swa.kv[0])))

    rng = np.random.default_rng(1)
    ql, qr = (jnp.asarray(rng.standard_normal((8, 4, d)), jnp.float32) for d in (16, 8))
    c_kv, k_pe = (jnp.asarray(rng.standard_normal((8, d)), jnp.float32) for d in (16, 8))
    mla = CachePools(kv=MLAKVPool.create(num_pages=8, page_size=PAGE, num_layers=1, kv_lora_rank=16,
                                         qk_rope_head_dim=8, dtype="float32"))
    mla_step = jax.jit(lambda pools, meta, mesh=None: attend(pools, 0, (ql, qr), c_kv, k_pe, meta, sm_scale=0.2,
                                                             mesh=mesh), static_argnums=2)
    meta = batch_metadata()
    result["mla_out"] = bool(np.allclose(mla_step(mla, meta)[0], mla_step(mla, meta, mesh)[0], atol=1e-5))
    print(json.dumps(result))
    """
)


def test_attend_on_a_two_device_mesh_equals_one_device():
    result = run_with_devices(["-c", CHECK], devices=2, timeout=300)
    assert result["mha_out"] and result["mha_pages"], result
    assert "tp" in result["mha_spec"], "the written layer stays sharded over the KV-head axis"
    assert result["kernel_per_device"], "the kernel runs inside shard_map over the sharded pool"
    assert result["explicit_mesh"], result
    assert result["swa_out"] and result["swa_pages"], result
    assert result["mla_out"], result
