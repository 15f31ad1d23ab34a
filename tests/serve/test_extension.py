"""The serving seams: per-kind hooks run at their points of the loop, their step inputs reach the
model as typed parts of ``AttentionMetadata``, and families come from one registry."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import ModelSpec
from kvjax.attention import StateMetadata
from kvjax.demo import demo_cache
from kvjax.errors import ConfigError
from kvjax.serve.checkpoint import param_name
from kvjax.serve.extension import ServingExtension, StepBatch
from kvjax.serve.families import SERVABLE_FAMILIES, family
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq


class RecordingExtension(ServingExtension):
    """Records every hook call; hands the step a recurrent-state part per batch (which a
    full-attention model never reads)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def poll(self) -> None:
        self.calls.append(("poll",))

    def after_admit(self, req: ServingReq) -> None:
        assert req.req_pool_idx is not None and req.lock_receipt is not None
        self.calls.append(("admit", req.rid, len(req.prefix_indices)))

    def before_decode(self, reqs) -> None:
        self.calls.append(("decode", tuple(r.rid for r in reqs)))

    def step_metadata(self, batch: StepBatch) -> StateMetadata:
        assert len(batch.rows) == len(batch.reqs) == len(batch.seq_lens) == len(batch.starts)
        assert int((batch.seq_lens - batch.starts).sum()) == len(batch.slots)
        self.calls.append(("metadata", batch.is_decode, len(batch.reqs)))
        rows = np.zeros(batch.max_seqs, np.int32)
        rows[: len(batch.rows)] = batch.rows
        zeros = np.zeros(batch.max_seqs, np.int32)
        return StateMetadata(state_slots=rows, has_initial_state=zeros, track_slots=zeros, track_at=zeros)

    def after_step(self, batch: StepBatch) -> None:
        self.calls.append(("stepped", len(batch.reqs)))

    def before_release(self, req: ServingReq, finished: bool) -> None:
        self.calls.append(("release", req.rid, finished))


@pytest.mark.parametrize("overlap", [True, False])
def test_hooks_run_at_their_points_and_metadata_reaches_the_step(overlap):
    spec = ModelSpec.preset("tiny")
    prompt = list(range(1, 40))

    def requests() -> list[ServingReq]:
        return [ServingReq("a", prompt, max_new_tokens=3), ServingReq("b", [*prompt, 7], max_new_tokens=2)]

    plain = Scheduler(spec, demo_cache(), init_params(spec), max_batch_size=4)
    assert plain.extensions == ()  # a full-attention cache needs no hooks
    expected = {r.rid: r.output_ids for r in plain.run(requests())}

    ext = RecordingExtension()
    sched = Scheduler(spec, demo_cache(), init_params(spec), max_batch_size=4, extensions=[ext], overlap=overlap)
    done = sched.run(requests())
    assert {r.rid: r.output_ids for r in done} == expected
    kinds = [c[0] for c in ext.calls]
    # Once per scheduler step; with overlap the last step only reads the last launched one.
    assert kinds.count("poll") == sched.stats.prefill_steps + sched.stats.decode_steps + overlap
    assert kinds.count("metadata") == kinds.count("stepped") == sched.stats.prefill_steps + sched.stats.decode_steps
    assert [c for c in ext.calls if c[0] == "admit"] == [("admit", "a", 0), ("admit", "b", 0)]
    assert [c for c in ext.calls if c[0] == "release"] == [("release", "b", True), ("release", "a", True)]
    assert kinds.index("decode") > kinds.index("admit")
    assert sched.leak_free()


def test_family_registry_names_what_it_serves():
    assert set(SERVABLE_FAMILIES) >= {"llama", "mistral", "qwen2", "qwen3"}
    assert family("qwen3").load("model").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        family("gpt2")


def test_list_items_map_to_checkpoint_names():
    assert param_name(("model", "layers_3", "mlp", "experts_7", "up_proj", "weight")) == (
        "model.layers.3.mlp.experts.7.up_proj.weight"
    )
    name = param_name(("model", "layers_0", "self_attn", "q_proj", "weight"))
    assert name == "model.layers.0.self_attn.q_proj.weight"
