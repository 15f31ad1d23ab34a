"""Pairs (and triples) of the combination matrix (``tests/combinations.py``) served over a tp 2 mesh
of CPU devices with Transformers' greedy tokens and logits (1e-4), each feature asserted in effect.

* The ``cpu_tensor`` retraction backup with the host tier at tp 2, for full attention (Llama) and
  MLA (DeepSeek-V2's latent pool, replicated over the ranks, the query heads split): the parity
  rounds on a device pool small enough to retract (the retracted requests restored from their
  copies, not recomputed) and then served in batches that evict prefixes to the host and load them
  back (each shard's pages).
  Overlap scheduling is on (the scheduler's default) throughout.
* Qwen3-Next's gated delta net at tp 2 (head parallel, ``tests/mesh/qwen3_next_tp.py``) with the
  host tier: KV and state checkpoints evicted to the host and loaded back, requests retracted.
"""

from __future__ import annotations

import pytest

from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler
from tests.mesh.qwen3_next_tp import qwen3_next_checkpoint
from tests.mesh.tp_serving import assert_sharded, family_checkpoint, mesh_of
from tests.serve.parity_harness import (
    assert_matches_transformers,
    build_scheduler,
    serve_batches_through_the_host,
    serve_recurrent,
    serve_two_rounds,
)

TP = 2
MAX_NEW = 6
ATOL = 1e-4


def _extension(sched: Scheduler, cls: type) -> object:
    [ext] = [e for e in sched.extensions if type(e) is cls]
    return ext


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
def test_tp2_cpu_tensor_retraction_backup_with_the_host_tier(family, tmp_path_factory):
    hf, model = family_checkpoint(family, tmp_path_factory)
    sched = build_scheduler(
        model,
        mesh=mesh_of(TP),
        tp_size=TP,
        page_size=1,
        max_total_tokens=48,  # small enough that retracted requests come back before their prefix is in the tree
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        disaggregation_decode_retraction_backup="cpu_tensor",
    )
    retraction = _extension(sched, RetractionBackupExtension).retraction  # type: ignore[attr-defined]
    host = _extension(sched, HostTierExtension)
    assert retraction.mode == "cpu_tensor" and sched.overlap
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.stats.retractions > 0 and retraction.restored > 0, "retracted requests should be restored"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
    done = serve_batches_through_the_host(sched, MAX_NEW)
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    assert host.loads > 0 and host.loaded_tokens > 0, "a prefix should come back from the host"  # type: ignore[attr-defined]
    assert sched.stats.evicted_tokens > 0
    assert sched.leak_free() and host.host_balanced() and retraction.held == 0  # type: ignore[attr-defined]
    tree.sanity_check()
    assert_sharded(sched, TP)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_qwen3_next_tp2_with_the_host_tier(tmp_path_factory):
    hf, model = qwen3_next_checkpoint(TP, tmp_path_factory)
    sched, done = serve_recurrent(
        model,
        MAX_NEW,
        mesh=mesh_of(TP),
        tp_size=TP,
        max_total_tokens=56,
        max_running_requests=4,
        max_mamba_cache_size=6,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    host = _extension(sched, HostTierExtension)
    tree = sched.cache.tree_cache
    tree.check_transfers(wait=True)
    assert sched.stats.retractions > 0 and sched.stats.evicted_tokens > 0
    assert host.loads > 0 and tree.mamba.loads > 0, "KV and a state checkpoint should come back from the host"  # type: ignore[attr-defined]
    assert sched.leak_free() and host.host_balanced()  # type: ignore[attr-defined]
    assert_sharded(sched, TP)
    assert all(a.sharding.spec[2] == "tp" for a in (*sched.cache.pools.recurrent.conv, sched.cache.pools.recurrent.ssm))
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
