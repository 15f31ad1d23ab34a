"""The DP serving step on host devices, run in a subprocess.

``python -m tests.mesh.dp_step_checks 2 4 2x2`` (at least 4 host devices) builds, for each
``dp`` (or ``dp x tp``: ``dp`` ranks of ``tp`` devices), the tiny model's DP cache, runs a
prefill step then two decode steps of every rank's own requests through ``make_dp_step`` (one
program for all ranks, pools donated) and, per rank, the single-rank step (``make_step``; at
``tp > 1`` ``make_sharded_step`` over the rank's own ``("tp",)`` mesh of ``tp`` devices) over a
cache ``build_kv_cache`` builds from the same plan; prints whether the next tokens, the logits and
the pools are bit-equal, and whether the donated pools were written in place (the same buffers,
the same sharding), as JSON. At ``tp > 1`` it also reports the collectives of the compiled DP
step (``collectives``): the all-reduces (shape, device groups), any other collective, the layer
count and each rank's ``"tp"`` devices.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import numpy as np
from jax.sharding import Mesh

from kvjax import ModelSpec, build_kv_cache
from kvjax.dp import build_dp_kv_cache, make_dp_step, place_params, stack_rank_inputs
from kvjax.serve.model import as_model_config, init_params
from kvjax.serve.step import make_sharded_step, make_step, place_on_mesh
from tests.mesh.dp_rank_requests import dp_config, place_rank_requests, rank_step_inputs


def main(dp: int, tp: int) -> dict:
    spec = ModelSpec.preset("tiny")
    config = dp_config(dp, tp)
    mesh = jax.make_mesh((dp, tp), ("data", "tp"), devices=jax.devices()[: dp * tp])
    cache = build_dp_kv_cache(spec, config, mesh)
    params = init_params(spec, seed=0)
    dp_step = make_dp_step(spec, cache.layout, with_logits=True)
    dp_params = place_params(spec, params, cache.layout)
    one_rank = config.replace(tp_size=tp, dp_size=1, enable_dp_attention=False)
    if tp == 1:
        single_step = make_step(spec, with_logits=True)
        refs = [build_kv_cache(spec, one_rank) for _ in range(dp)]
        rank_params = [params] * dp
    else:
        rank_meshes = [Mesh(cache.layout.mesh.devices[r], ("tp",)) for r in range(dp)]
        refs = [build_kv_cache(spec, one_rank, mesh=m) for m in rank_meshes]
        placed = [place_on_mesh(spec, ref.pools, params, m) for ref, m in zip(refs, rank_meshes, strict=True)]
        for ref, (pools, _) in zip(refs, placed, strict=True):
            ref.set_pools(pools)
        rank_params = [p for _, p in placed]
        steps = [
            make_sharded_step(spec, m, ref.pools, with_logits=True) for m, ref in zip(rank_meshes, refs, strict=True)
        ]
    rng = np.random.default_rng(dp)
    ranks = place_rank_requests(cache, rng, decode_tokens=2)
    tokens_equal, logits_equal, pools_equal, in_place = [], [], [], []
    last = [None] * dp
    for step in range(3):
        per_rank = []
        for r, requests in enumerate(ranks):
            lens = requests[2]
            if step == 0:
                per_rank.append(
                    rank_step_inputs(requests, [rng.integers(0, 256, n).astype(np.int32) for n in lens], None)
                )
            else:
                per_rank.append(rank_step_inputs(requests, np.asarray(last[r][: len(lens)], np.int32), step - 1))
        tokens, meta = stack_rank_inputs([t for t, _ in per_rank], [m for _, m in per_rank])
        before = cache.pools.kv.kv[0]
        pointers = [shard.data.unsafe_buffer_pointer() for shard in before.addressable_shards]
        pools, next_tokens, logits = dp_step(cache.pools, dp_params, tokens, meta)
        after = pools.kv.kv[0]
        in_place.append(
            before.is_deleted()
            and after.sharding.is_equivalent_to(before.sharding, after.ndim)
            and [shard.data.unsafe_buffer_pointer() for shard in after.addressable_shards] == pointers
        )
        cache.set_pools(pools)
        next_tokens, logits = np.asarray(next_tokens), np.asarray(logits)
        layers = [np.asarray(layer) for layer in pools.kv.kv]
        for r in range(dp):
            m = jax.tree.map(lambda x, r=r: x[r], meta)
            run = single_step if tp == 1 else steps[r]
            ref_pools, ref_next, ref_logits = run(refs[r].pools, rank_params[r], tokens[r], m)
            refs[r].set_pools(ref_pools)
            tokens_equal.append(bool(np.array_equal(next_tokens[r], np.asarray(ref_next))))
            logits_equal.append(bool(np.array_equal(logits[r], np.asarray(ref_logits))))
            pools_equal.append(
                all(np.array_equal(layers[i][r], np.asarray(ref_pools.kv.kv[i])) for i in range(len(layers)))
            )
            last[r] = next_tokens[r]
    facts: dict = {
        "tokens_equal": tokens_equal,
        "logits_equal": logits_equal,
        "pools_equal": pools_equal,
        "written_in_place": in_place,
    }
    if tp > 1:
        facts["collectives"] = collectives(
            dp_step.jitted.lower(cache.pools, dp_params, tokens, meta, None, None).compile().as_text()
        )
        facts["collectives"]["layers"] = as_model_config(spec).num_hidden_layers
        facts["collectives"]["hidden"] = as_model_config(spec).hidden_size
        facts["collectives"]["rank_devices"] = [[d.id for d in row] for row in cache.layout.mesh.devices]
    return facts


def collectives(text: str) -> dict:
    """The compiled program's all-reduces (``[shape, device groups]`` each) and the names of any
    other collectives."""
    reduces = []
    for shape, groups in re.findall(r"= (\S+) all-reduce(?:-start)?\(.*?replica_groups=(\S+)", text):
        reduces.append([shape, replica_groups(groups.rstrip(","))])
    others = re.findall(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", text)
    return {"all_reduces": reduces, "others": sorted(set(others))}


def replica_groups(text: str) -> list[list[int]]:
    """HLO replica groups, explicit (``{{0,1},{2,3}}``) or iota (``[2,2]<=[4]``,
    ``[2,2]<=[2,2]T(1,0)``), as lists of device ids."""
    if text.startswith("{"):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text)]
    m = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m is None:
        raise ValueError(f"unknown replica groups {text!r}")
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()


if __name__ == "__main__":
    shapes = {arg: [int(x) for x in arg.split("x")] + ([1] if "x" not in arg else []) for arg in sys.argv[1:]}
    print(json.dumps({arg: main(dp, tp) for arg, (dp, tp) in shapes.items()}))
