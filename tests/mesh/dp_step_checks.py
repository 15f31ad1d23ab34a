"""The DP serving step on host devices, run in a subprocess.

``python -m tests.mesh.dp_step_checks 2 4`` (at least 4 host devices) builds, for each ``dp``,
the tiny model's DP cache with one device per rank, runs a prefill step then two decode steps of
every rank's own requests through ``make_dp_step`` (one program for all ranks, pools donated)
and, per rank, the single-rank ``make_step`` over a cache ``build_kv_cache`` builds from the same
config; prints whether the next tokens, the logits and the pools are bit-equal, as JSON.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from kvjax import ModelSpec, build_kv_cache
from kvjax.dp import build_dp_kv_cache, make_dp_step, replicate_params, stack_rank_inputs
from kvjax.serve.model import init_params
from kvjax.serve.step import make_step
from tests.mesh.dp_rank_requests import dp_config, place_rank_requests, rank_step_inputs


def main(dp: int) -> dict:
    spec = ModelSpec.preset("tiny")
    config = dp_config(dp, 1)
    cache = build_dp_kv_cache(spec, config, jax.make_mesh((dp, 1), ("data", "tp")))
    params = init_params(spec, seed=0)
    dp_step = make_dp_step(spec, cache.layout, with_logits=True)
    dp_params = replicate_params(params, cache.layout)
    single_step = make_step(spec, with_logits=True)
    refs = [build_kv_cache(spec, config) for _ in range(dp)]
    rng = np.random.default_rng(dp)
    ranks = place_rank_requests(cache, rng, decode_tokens=2)
    tokens_equal, logits_equal, pools_equal = [], [], []
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
        pools, next_tokens, logits = dp_step(cache.pools, dp_params, tokens, meta)
        cache.set_pools(pools)
        next_tokens, logits = np.asarray(next_tokens), np.asarray(logits)
        layers = [np.asarray(layer) for layer in pools.kv.kv]
        for r in range(dp):
            m = jax.tree.map(lambda x, r=r: x[r], meta)
            ref_pools, ref_next, ref_logits = single_step(refs[r].pools, params, tokens[r], m)
            refs[r].set_pools(ref_pools)
            tokens_equal.append(bool(np.array_equal(next_tokens[r], np.asarray(ref_next))))
            logits_equal.append(bool(np.array_equal(logits[r], np.asarray(ref_logits))))
            pools_equal.append(
                all(np.array_equal(layers[i][r], np.asarray(ref_pools.kv.kv[i])) for i in range(len(layers)))
            )
            last[r] = next_tokens[r]
    return {"tokens_equal": tokens_equal, "logits_equal": logits_equal, "pools_equal": pools_equal}


if __name__ == "__main__":
    print(json.dumps({arg: main(int(arg)) for arg in sys.argv[1:]}))
