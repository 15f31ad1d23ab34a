"""DP attention with recurrent state across two processes: the tiny Qwen3-Next of
``test_dp_parity`` (gated delta net layers and a full-attention layer) served by the lockstep DP
front at dp 2 x tp 2 over 2 processes x 2 CPU devices (``group_dp_mesh``: each rank's devices one
process's) gives Transformers' greedy tokens and logits through prefix reuse from state
checkpoints, chunked prefill, eviction and retraction (each asserted).

Every process runs every rank's scheduler; the checkpoint forks and copies a rank's tree queues
run as one program over the mesh of both processes (``kvjax.dp.rank_state``, its slot ids
replicated, each rank reading its own row). Both processes route alike, finish the same requests
with the same tokens, compare every rank's digest and the routing at every step, and end with no
KV slot or state slot lost on any rank.

Run as a program (``python -m tests.mesh.test_multihost_dp_recurrent DIR``) it is one process of
the group.
"""

from __future__ import annotations

import json
import sys

from tests.mesh.multihost_group import assert_all_ok, finished_requests, join_and_load, request_records, run_group
from tests.mesh.qwen3_next_tp import HEADS as QWEN3_NEXT_HEADS
from tests.mesh.qwen3_next_tp import LAYERS as QWEN3_NEXT_LAYERS
from tests.mesh.test_dp_parity import DP, MAX_NEW, RECURRENT_POOLS, TP
from tests.serve.parity_harness import (
    CHUNK,
    TINY_CONFIG,
    assert_matches_transformers,
    parity_cache_config,
    saved_transformers_model,
    serve_two_rounds,
    transformers,
)
from tests.serve.test_parity_qwen3_next import MODEL_SEED

ATOL = 1e-4


def test_qwen3_next_at_dp_2_tp_2_over_two_processes_matches_transformers(tmp_path_factory):
    config = transformers.Qwen3NextConfig(**TINY_CONFIG, **QWEN3_NEXT_LAYERS, **QWEN3_NEXT_HEADS[TP])
    hf, directory = saved_transformers_model(config, tmp_path_factory, "qwen3_next", seed=MODEL_SEED)
    args = ["-m", "tests.mesh.test_multihost_dp_recurrent", str(directory)]
    reports = assert_all_ok(run_group(args, devices=TP, timeout=300))
    assert reports[0]["outputs"] == reports[1]["outputs"]
    assert reports[0]["rank_of"] == reports[1]["rank_of"]
    assert reports[0]["rank_processes"] == [[0] * TP, [1] * TP]  # each rank's "tp" devices one process's
    assert sorted(set(reports[0]["rank_of"].values())) == [0, 1], reports[0]["rank_of"]  # both ranks serve
    for r in reports:
        assert r["leak_free"] and r["state_slots_balanced"] and r["digest_checks"] > 0, r
        assert r["state_copies_applied"] > 0, r  # checkpoint forks and copies ran on the ranks' slices
        assert r["cached_tokens"] > 0 and r["evicted_tokens"] > 0 and r["retractions"] > 0, r
    assert_matches_transformers(hf, finished_requests(reports[0], MAX_NEW), max_new=MAX_NEW, atol=ATOL)


def _serve(directory: str) -> dict:
    group, model = join_and_load(directory)
    from kvjax.dp import LockstepDPScheduler
    from kvjax.radix.mamba_radix_cache import MambaRadixCache
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.multihost.mesh import group_dp_mesh

    config = parity_cache_config(page_size=1, tp_size=DP * TP, dp_size=DP, enable_dp_attention=True, **RECURRENT_POOLS)
    mesh = group_dp_mesh(DP * TP, DP)
    lockstep = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
    )
    front = MultiProcessFront(lockstep, group.channel, check_agreement=True)
    serve_two_rounds(front, MAX_NEW)  # type: ignore[arg-type]  # a front serves like a scheduler
    balanced = []
    for scheduler in lockstep.schedulers:
        table, tree = scheduler.cache.req_to_token_pool, scheduler.cache.tree_cache
        held = tree.mamba_evictable_size() + tree.mamba_protected_size() if isinstance(tree, MambaRadixCache) else 0
        balanced.append(table.mamba_allocator.available_size() + held == table.mamba_pool_size)
    stats = [s.stats for s in lockstep.schedulers]
    return {
        "outputs": {str(r.rid): list(r.output_ids) for r in front.finished},
        "requests": request_records(front.finished),
        "rank_of": {str(rid): rank for rid, rank in lockstep.rank_of.items()},
        "rank_processes": [[d.process_index for d in row] for row in mesh.devices],
        "leak_free": front.leak_free(),
        "state_slots_balanced": all(balanced),
        "state_copies_applied": sum(s.cache.pending.applied for s in lockstep.schedulers),
        "digest_checks": front.digest_checks,
        "cached_tokens": sum(st.cached_tokens for st in stats),
        "evicted_tokens": sum(st.evicted_tokens for st in stats),
        "retractions": sum(st.retractions for st in stats),
    }


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1])))
