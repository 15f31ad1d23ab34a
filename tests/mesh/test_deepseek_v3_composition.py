"""DeepSeek-V3's serving composition across processes (issue 35): a tiny DeepSeek-V3 checkpoint
(MLA, sparse MoE with the ``noaux_tc`` router and its correction bias, one MTP layer) under DP
attention, 2 ranks x tp 4 over 2 processes x 4 CPU devices (``group_dp_mesh``: each rank's "tp"
devices one process's; SGLang's recommended DeepSeek-V3 deployment), every rank decoding
speculatively with the MTP layer (EAGLE/NEXTN: ``kvjax.dp.speculative``), with a host tier per rank
under memory pressure (page 1, a 48-token device pool per rank; the parity prompts in batches
routed round robin, ``serve_batches_through_the_host``: rank 1 evicts the chat's first turn to its
host pool and loads it back for the second turn, the MTP layer's latent pool with the target's),
every process's state digest compared at every step, and overlap scheduling (SGLang's default):
each rank's round ``N + 1`` is launched before its host reads round ``N``, chained on the device
from its row of the DP round before (``kvjax.dp.speculative``).

Every request's tokens equal Transformers' greedy ``generate`` and its logits (the target's, from
the verify forwards) agree within 1e-4; on every process both ranks serve and every rank ends leak
free with a balanced host pool; pages came back from a host pool, proposals were rejected and
rolled back; both ranks overlapped rounds.

Run as a program (``python -m tests.mesh.test_deepseek_v3_composition DIR`` with the flags
``run_group`` appends) it serves the rounds as one process of the group.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.mesh.multihost_group import (
    assert_all_ok,
    finished_requests,
    join_and_load,
    request_records,
    run_group,
)
from tests.serve.parity_harness import CHUNK, assert_matches_transformers, serve_batches_through_the_host

pytestmark = pytest.mark.mesh

DP, TP = 2, 4  # DP attention: 2 ranks of tp 4, one process's 4 devices each
MAX_NEW = 6
LOGIT_ATOL = 1e-4
POOL_TOKENS = 48  # per rank, small: the rounds evict to the host and load prefixes back


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> tuple[Any, Path]:
    """(Transformers' target, its checkpoint with a random MTP layer added)."""
    from kvjax.serve.checkpoint import load_checkpoint
    from tests.serve.test_parity_deepseek_v3 import deepseek_v3_checkpoint
    from tests.serve.test_speculative_eagle import add_mtp_layer

    root = tmp_path_factory.mktemp("deepseek_v3")
    plain, directory = root / "plain", root / "mtp"
    hf = deepseek_v3_checkpoint(plain)
    shutil.copytree(plain, directory)
    add_mtp_layer(directory, load_checkpoint(plain))
    return hf, directory


@pytest.mark.timeout(600)
def test_dp_2_tp_4_over_two_processes_with_mtp_and_the_host_tier_under_pressure(deepseek_v3):
    hf, directory = deepseek_v3
    reports = assert_all_ok(
        run_group(["-m", "tests.mesh.test_deepseek_v3_composition", str(directory)], devices=TP, timeout=500)
    )
    for report in reports:
        assert report["leak_free"] == [True] * DP and report["host_balanced"] == [True] * DP, report
        assert report["digest_checks"] > 0 and report["draft_host_pools"] == [True] * DP, report
        assert report["host_loaded_tokens"] > 0 and report["evicted_tokens"] > 0, report
        assert report["rolled_back_slots"] > 0, report
        assert all(n > 0 for n in report["overlapped_rounds"]), report  # every rank chained rounds
        assert sorted(set(report["rank_of"].values())) == list(range(DP)), report["rank_of"]  # both ranks serve
    assert reports[0]["rank_processes"] == [[0] * TP, [1] * TP]  # each rank's "tp" devices one process's
    assert reports[0]["requests"] == reports[1]["requests"]
    assert reports[0]["rank_of"] == reports[1]["rank_of"]
    assert_matches_transformers(hf, finished_requests(reports[0], MAX_NEW), max_new=MAX_NEW, atol=LOGIT_ATOL)


def _serve(directory: str) -> dict[str, Any]:
    group, model = join_and_load(directory)
    from kvjax.dp import LockstepDPScheduler, RankDraft
    from kvjax.dp.speculative import RankEagleDecoding
    from kvjax.serve.host_tier import HostTierExtension
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.multihost.mesh import group_dp_mesh
    from kvjax.serve.speculative.nextn import nextn_params
    from tests.serve.test_speculative_eagle import K, nextn_config

    config = nextn_config(
        page_size=1,
        max_total_tokens=POOL_TOKENS,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
    )
    mesh = group_dp_mesh(DP * TP, DP)
    lockstep = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        policy="round_robin",  # a, b, d on rank 0; chat1, c, then chat2 on rank 1 (its prefix back from the host)
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
        overlap=True,
        agreement=group.agreement(),  # each rank's host transfers complete at the same step everywhere
        draft=RankDraft(nextn_params(model.config, model.params, directory), K),
    )
    front = MultiProcessFront(lockstep, group.channel, check_agreement=True)
    serve_batches_through_the_host(front, MAX_NEW)  # type: ignore[arg-type]  # a front serves as a scheduler does
    hosts, rolled_back, overlapped = [], 0, []
    for scheduler in lockstep.schedulers:
        proposer = scheduler.proposer
        assert isinstance(proposer, RankEagleDecoding)
        rolled_back += proposer.stats.rolled_back_slots
        overlapped.append(proposer.stats.overlapped_rounds)
        scheduler.cache.tree_cache.check_transfers(wait=True)
        hosts.append(next(e for e in scheduler.extensions if isinstance(e, HostTierExtension)))
    return {
        # every process's own requests (process 1 makes its copies of process 0's from the exchange)
        "requests": request_records(front.finished),
        "rank_of": {str(rid): rank for rid, rank in lockstep.rank_of.items()},
        "rank_processes": [[d.process_index for d in row] for row in mesh.devices],
        "leak_free": [s.leak_free() for s in lockstep.schedulers],
        "host_balanced": [h.host_balanced() for h in hosts],
        "host_loaded_tokens": sum(h.loaded_tokens for h in hosts),
        "evicted_tokens": sum(s.stats.evicted_tokens for s in lockstep.schedulers),
        "rolled_back_slots": rolled_back,
        "overlapped_rounds": overlapped,
        "draft_host_pools": [s.cache.draft_host_pool is not None for s in lockstep.schedulers],
        "digest_checks": front.digest_checks,
    }


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1])))
