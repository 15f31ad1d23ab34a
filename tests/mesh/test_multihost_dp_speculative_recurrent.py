"""Speculative decoding of a recurrent-state target under DP attention across two processes.

Qwen3-Next's own MTP layer drafting (NEXTN; ``tests/serve/test_qwen3_next_mtp``'s checkpoint,
a random layer: most rounds reject) served by the lockstep DP front at dp 2 x tp 2 over 2
processes x 2 CPU devices (``group_dp_mesh``: each rank's devices one process's). Every process
runs every rank's scheduler, so each rank's replay after a rejecting round (its state snapshot
and restore in its slice, its kept tokens replayed as a DP step of its batch:
``kvjax.dp.speculative``) is decided alike on both processes from the same round's outputs and
runs as one program over the mesh of both. Both processes route alike, compare every rank's
digest at every step, finish the same requests with the same tokens (Transformers' greedy
tokens, logits within the single-process test's tolerance), replay on both ranks and end with
no KV or state slot lost on any rank.

Run as a program (``python -m tests.mesh.test_multihost_dp_speculative_recurrent DIR``) it is
one process of the group.
"""

from __future__ import annotations

import json
import sys

from tests.mesh.multihost_group import assert_all_ok, finished_requests, join_and_load, request_records, run_group
from tests.serve.parity_harness import CHUNK, assert_matches_transformers, parity_cache_config, serve_two_rounds
from tests.serve.test_qwen3_next_mtp import LOGIT_ATOL, MAX_NEW, K, _checkpoints

DP, TP = 2, 2
POOL_TOKENS = 44  # per rank, as tests/mesh/test_dp_speculative_recurrent.py: evicts the tree's prefixes


def test_qwen3_next_mtp_at_dp_2_tp_2_over_two_processes_replays_alike(tmp_path_factory):
    hf, _, directory = _checkpoints(str(tmp_path_factory.mktemp("qwen3_next_mtp_processes")))
    args = ["-m", "tests.mesh.test_multihost_dp_speculative_recurrent", str(directory)]
    reports = assert_all_ok(run_group(args, devices=TP, timeout=300))
    assert reports[0]["outputs"] == reports[1]["outputs"]
    assert reports[0]["rank_of"] == reports[1]["rank_of"]
    assert reports[0]["replayed"] == reports[1]["replayed"], "the processes replayed differently"
    assert reports[0]["rank_processes"] == [[0] * TP, [1] * TP]  # each rank's "tp" devices one process's
    assert sorted(set(reports[0]["rank_of"].values())) == [0, 1], reports[0]["rank_of"]  # both ranks serve
    for r in reports:
        assert r["leak_free"] and r["state_slots_balanced"] and r["digest_checks"] > 0, r
        assert all(n > 0 for n in r["replayed"]) and r["replay_steps"] > 0, r  # every rank replayed
        assert r["cached_tokens"] > 0 and r["evicted_tokens"] > 0, r
    assert_matches_transformers(hf, finished_requests(reports[0], MAX_NEW), max_new=MAX_NEW, atol=LOGIT_ATOL)


def _serve(directory: str) -> dict:
    group, model = join_and_load(directory)
    from kvjax.dp import LockstepDPScheduler
    from kvjax.dp.speculative import RankDraft
    from kvjax.radix.mamba_radix_cache import MambaRadixCache
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.multihost.mesh import group_dp_mesh
    from kvjax.serve.speculative.nextn import nextn_params

    config = parity_cache_config(
        page_size=1,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
        speculative_algorithm="NEXTN",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
    )
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
        draft=RankDraft(nextn_params(model.config, model.params, directory), K),
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
        "replayed": [s.proposer.stats.replayed_requests for s in lockstep.schedulers],  # type: ignore[union-attr]
        "replay_steps": lockstep.replay_steps,
        "digest_checks": front.digest_checks,
        "cached_tokens": sum(st.cached_tokens for st in stats),
        "evicted_tokens": sum(st.evicted_tokens for st in stats),
    }


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1])))
