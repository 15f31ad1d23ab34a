"""The ``cpu_tensor`` decode retraction backup over recurrent state at tp 2 (Qwen3-Next, tiny: its
gated delta net head-parallel, the state pool split over ``"tp"``): a retracted request's state
slot is copied with every rank's share of its rows and written back into its new slot, beside the
host tier (prefixes and checkpoints evicted to the host and loaded back). The workload and the
checks of ``tests/serve/test_recurrent_retraction.py``: restored (the backup's counters), not
recomputed; Transformers' tokens and logits; KV, state slots and host pools leak free."""

from __future__ import annotations

from tests.mesh.qwen3_next_tp import qwen3_next_checkpoint
from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.parity_harness import assert_matches_transformers, serve_recurrent
from tests.serve.test_recurrent_host_tier import assert_leak_free
from tests.serve.test_recurrent_retraction import MAX_NEW, SMALL, _assert_restored_and_leak_free

TP = 2
ATOL = 2e-4


def test_qwen3_next_tp2_restores_retracted_requests_state_beside_the_host_tier(tmp_path_factory):
    hf, model = qwen3_next_checkpoint(TP, tmp_path_factory)
    sched, done = serve_recurrent(
        model,
        MAX_NEW,
        mesh=mesh_of(TP),
        tp_size=TP,
        disaggregation_decode_retraction_backup="cpu_tensor",
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        **SMALL,
    )
    assert_sharded(sched, TP)
    assert all(a.sharding.spec[2] == "tp" for a in sched.cache.pools.recurrent.arrays())
    _assert_restored_and_leak_free(sched)
    assert_leak_free(sched)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
