"""The storage tier under the hybrid sliding-window tree at tp 2 (Gemma 3, tiny: two KV heads): both
stores, the full layers' and the sliding layers', keep each TP rank's heads of a page as an entry of
its own (``kvjax.transfers.storage_attach``), and the workload of ``tests/serve/test_swa_storage.py``
(every second-round prefix evicted from the device and the host, back from storage with its last
window) gives Transformers' tokens and logits."""

from __future__ import annotations

from tests.mesh.tp_serving import assert_sharded, family_checkpoint, mesh_of
from tests.serve.test_swa_storage import serve_from_storage, storage_scheduler

TP = 2


def test_gemma3_storage_tier_at_tp_2_stores_each_ranks_heads(tmp_path_factory):
    hf, model = family_checkpoint("gemma3", tmp_path_factory)
    sched = storage_scheduler(model, mesh=mesh_of(TP), tp_size=TP)
    link = sched.cache.tree_cache.storage
    assert link is not None and link.window is not None
    for store in (link.storage, link.window.store):
        assert [rank for rank, _ in store.shards] == list(range(TP)), store.shards
    assert_sharded(sched, TP)
    serve_from_storage(hf, sched)
