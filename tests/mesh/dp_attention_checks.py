"""The DP-attention checks on a ``("data", "tp")`` mesh of host devices, run in a subprocess.

``python -m tests.mesh.dp_attention_checks 2x2 4x2`` (with at least ``dp * tp`` host devices:
``XLA_FLAGS=--xla_force_host_platform_device_count=8``) builds, for each ``DPxTP``, the tiny
model's DP cache, runs a prefill step and a decode step of every rank's own requests through
``dp_attend`` (jitted, pools donated) and reports the layout facts, and whether each rank's
outputs and pools are bit-equal to kvjax's unsharded ``attend`` over that rank's inputs alone.
It also reports the errors of meshes and configs that do not match. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax import ModelSpec
from kvjax.attention import attend
from kvjax.dp import build_dp_kv_cache, dp_attend, stack_rank_inputs
from kvjax.pools import CachePools, MHAKVPool
from tests.mesh.dp_rank_requests import PAGE, dp_config, place_rank_requests, rank_step_inputs


def refusals() -> dict:
    """The error of each mismatch, built on a 2 x 2 mesh (nothing is allocated)."""
    spec = ModelSpec.preset("tiny")
    mesh = jax.make_mesh((2, 2), ("data", "tp"))
    cases = {
        "dp_off": (dp_config(2, 2, enable_dp_attention=False), mesh),
        "dp_size": (dp_config(4, 1, tp_size=4), mesh),
        "tp_size": (dp_config(2, 1), mesh),
        "axes": (dp_config(2, 2), jax.make_mesh((2, 2), ("dp", "tp"))),
        "storage_tier": (
            dp_config(
                2,
                2,
                enable_hierarchical_cache=True,
                hicache_storage_backend="file",
                hicache_storage_dir="unused",
                hicache_storage_model_fingerprint="unused",
                kv_cache_dtype="fp8_e4m3",
            ),
            mesh,
        ),
    }
    out = {}
    for name, (config, m) in cases.items():
        try:
            build_dp_kv_cache(spec, config, m)
            out[name] = None
        except (ValueError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def kinds() -> dict:
    """Each kind's DP cache on a 2 x 2 mesh: its tree, and each pool array's shape and spec (or
    the error of a kind not built under DP attention)."""
    from tests.specs import F, R, ssm

    mesh = jax.make_mesh((2, 2), ("data", "tp"))
    out: dict = {}
    for name in ("deepseek-tiny", "mistral-swa-tiny", "gemma3-tiny", "recurrent"):
        if name == "recurrent":
            spec = ssm((R, F))
            config = dp_config(2, 2, page_size=1, disable_radix_cache=True, max_mamba_cache_size=4)
        else:
            spec = ModelSpec.preset(name)
            config = dp_config(2, 2)
        try:
            cache = build_dp_kv_cache(spec, config, mesh)
        except NotImplementedError as e:
            out[name] = f"NotImplementedError: {e}"
            continue
        arrays = {}
        for pool in cache.pools.names:
            leaves = jax.tree_util.tree_leaves(cache.pools[pool])
            specs = jax.tree_util.tree_leaves(cache.layout.pool_specs[pool], is_leaf=lambda x: isinstance(x, P))
            arrays[pool] = [
                [
                    list(leaf.shape),
                    [str(a) for a in spec],
                    leaf.sharding.is_equivalent_to(as_planned(cache, spec), leaf.ndim),
                ]
                for leaf, spec in zip(leaves, specs, strict=True)
            ]
        out[name] = {"tree": type(cache.ranks[0].tree_cache).__name__, "arrays": arrays}
    return out


def as_planned(cache: Any, spec: P) -> NamedSharding:
    """The sharding ``spec`` names over the DP cache's mesh."""
    return NamedSharding(cache.layout.mesh, spec)


def padded_spec(array: jax.Array) -> list[str]:
    """The array's ``PartitionSpec`` entries, one per dimension (a spec may leave trailing
    replicated dimensions out)."""
    spec = list(array.sharding.spec)
    return [str(a) for a in spec + [None] * (array.ndim - len(spec))]


def main(dp: int, tp: int) -> dict:
    spec = ModelSpec.preset("tiny")  # 4 query heads, 2 KV heads, head_dim 16, 2 layers
    config = dp_config(dp, tp)
    mesh = jax.make_mesh((dp, tp), ("data", "tp"))
    cache = build_dp_kv_cache(spec, config, mesh)
    layer0 = cache.pools.kv.kv[0]
    facts = {
        "shape": list(layer0.shape),
        "shard": list(layer0.addressable_shards[0].data.shape),
        "spec": padded_spec(layer0),
        "scale_shape": list(cache.pools.kv.k_scale.shape),
        "local_heads": cache.pools.kv.num_kv_heads,
        "ranks": len(cache.ranks),
        "distinct_trees": len({id(r.tree_cache) for r in cache.ranks}),
    }
    pages = layer0.shape[1] - 1
    rng = np.random.default_rng(dp * 10 + tp)
    ranks = place_rank_requests(cache, rng, decode_tokens=1)
    facts["allocators_independent"] = len({r.allocator.available_size() for r, _, _ in ranks}) > 1

    def step_inputs(prefill: bool):
        tokens, metas = [], []
        for requests in ranks:
            lens = requests[2]
            if prefill:
                t, m = rank_step_inputs(requests, [rng.integers(0, 256, n).astype(np.int32) for n in lens], None)
            else:
                t, m = rank_step_inputs(requests, rng.integers(0, 256, len(lens)).astype(np.int32), 0)
            tokens.append(t)
            metas.append(m)
        return stack_rank_inputs(tokens, metas)

    def qkv(width: int):
        def draw(heads):
            return rng.standard_normal((dp, width, heads, 16)).astype(np.float32)

        return draw(4), draw(2), draw(2)

    refs = [
        CachePools(
            kv=MHAKVPool.create(
                num_pages=pages,
                page_size=PAGE,
                num_layers=2,
                num_kv_heads=2,
                head_dim=16,
                dtype="float32",
                platform="cpu",
            )
        )
        for _ in range(dp)
    ]
    layout = cache.layout

    def dp_step(pools, q, k, v, meta):
        out0, pools = dp_attend(pools, 0, q, k, v, meta, layout=layout)
        out1, pools = dp_attend(pools, 1, q * 0.5, k, v, meta, layout=layout, soft_cap=20.0)
        return out0, out1, pools

    step = jax.jit(dp_step, donate_argnums=0)
    equal_out, equal_pools, in_place = [], [], []
    for prefill in (True, False):
        tokens, meta = step_inputs(prefill)
        q, k, v = qkv(tokens.shape[1])
        pointer = cache.pools.kv.kv[0].addressable_shards[0].data.unsafe_buffer_pointer()
        out0, out1, pools = step(cache.pools, q, k, v, meta)
        cache.set_pools(pools)
        in_place.append(pools.kv.kv[0].addressable_shards[0].data.unsafe_buffer_pointer() == pointer)
        out0, out1 = np.asarray(out0), np.asarray(out1)
        layers = [np.asarray(layer) for layer in pools.kv.kv]
        for r in range(dp):
            m = jax.tree.map(lambda x, r=r: x[r], meta)
            ref0, refs[r] = attend(refs[r], 0, jnp.asarray(q[r]), k[r], v[r], m)
            ref1, refs[r] = attend(refs[r], 1, jnp.asarray(q[r] * 0.5), k[r], v[r], m, soft_cap=20.0)
            equal_out.append(
                bool(np.array_equal(out0[r], np.asarray(ref0))) and bool(np.array_equal(out1[r], np.asarray(ref1)))
            )
            equal_pools.append(all(np.array_equal(layers[i][r], np.asarray(refs[r].kv.kv[i])) for i in range(2)))
    facts.update(outputs_equal=equal_out, pools_equal=equal_pools, in_place=in_place)
    facts["nonzero"] = bool(np.abs(np.asarray(cache.pools.kv.kv[0])).sum() > 0)
    return facts


if __name__ == "__main__":
    result: dict = {"refusals": refusals(), "kinds": kinds()}
    for arg in sys.argv[1:]:
        dp, tp = (int(x) for x in arg.split("x"))
        result[arg] = main(dp, tp)
    print(json.dumps(result))
