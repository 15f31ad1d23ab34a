"""The storage tier under the recurrent-state tree at tp 2 (Qwen3-Next, tiny: its gated delta net
head-parallel, the recurrent state pool split over ``"tp"``): a stored checkpoint holds every rank's
share of the state (the host state pool's rows, ``kvjax.radix.storage_checkpoint``), the KV pages
each rank's heads as an entry of its own, and the workload of
``tests/serve/test_recurrent_storage.py`` (every second-round prefix evicted from the device and the
host, back from storage with the state after it) gives Transformers' tokens and logits."""

from __future__ import annotations

from tests.mesh.qwen3_next_tp import qwen3_next_checkpoint
from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.test_recurrent_storage import serve_from_storage, storage_scheduler

TP = 2


def test_qwen3_next_storage_tier_at_tp_2_brings_back_every_ranks_state(tmp_path_factory):
    hf, model = qwen3_next_checkpoint(TP, tmp_path_factory)
    sched = storage_scheduler(model, mesh=mesh_of(TP), tp_size=TP)
    link = sched.cache.tree_cache.storage
    assert link is not None and link.checkpoints is not None
    assert [rank for rank, _ in link.storage.shards] == list(range(TP)), link.storage.shards
    assert link.checkpoints.store.storage_key.tp_size == TP
    assert_sharded(sched, TP)
    serve_from_storage(hf, sched)
