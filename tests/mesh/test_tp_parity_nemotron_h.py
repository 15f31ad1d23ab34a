"""Nemotron-H (Mamba2 mixers with two B/C groups, attention, ReLU² MLPs) at tp 2 over CPU devices
gives Transformers' greedy tokens, and logits within 1e-4 (float32) of Transformers' full forward
over prompt + output (why the full forward: ``tests/serve/test_parity_nemotron_h.py``), through
prefix reuse from state checkpoints, chunked prefill, eviction and retraction (each asserted).

The Mamba2 mixers run head-parallel (``kvjax.attention.recurrent_step.recurrent_mixer_over_heads``):
each rank holds whole B/C groups with their heads (``in_proj`` rows and conv channels re-laid out
rank-major at load by ``kvjax.serve.param_sharding``), runs its heads' recurrence over its shard of
the state pool, and one all-reduce sums ``out_proj``'s partial products.
"""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.mesh.tp_serving import serve_recurrent_over_tp
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_no_near_tie,
    tiny_checkpoint,
    torch,
    transformers,
)
from tests.serve.random_workloads import NEMOTRON_H_BLOCKS, TINY_LAYER_SIZES
from tests.serve.test_parity_nemotron_h import LOGIT_ATOL, MIN_MARGIN, MODEL_SEED

MAX_NEW = 6
TP = 2


@pytest.mark.timeout(600)  # ~2 min on a quiet machine; shared CPUs stretch it
def test_head_parallel_mamba2_reuse_eviction_and_retraction(tmp_path_factory):
    config = transformers.NemotronHConfig(**TINY_CONFIG, **TINY_LAYER_SIZES, **NEMOTRON_H_BLOCKS)
    hf, model = tiny_checkpoint(config, tmp_path_factory, "nemotron_h_tp", seed=MODEL_SEED)
    sched, done = serve_recurrent_over_tp(model, MAX_NEW, TP)
    mixer = sched.params["backbone"]["layers_0"]["mixer"]
    assert mixer["in_proj"]["weight"].sharding.spec == P("tp", None)
    assert mixer["conv1d"]["weight"].sharding.spec == P("tp", None, None)
    assert mixer["out_proj"]["weight"].sharding.spec == P(None, "tp")
    assert mixer["norm"]["weight"].sharding.spec == P("tp") and mixer["D"].sharding.spec == P("tp")
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    for name, req in done.items():
        prompt = list(req.origin_input_ids)
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt) :]
            full = hf(torch.tensor([prompt + req.output_ids])).logits[0].numpy()
        logits = full[len(prompt) - 1 : len(prompt) - 1 + MAX_NEW]
        assert_no_near_tie(name, logits, MIN_MARGIN)
        assert req.output_ids == want.tolist(), f"{name}: kvjax {req.output_ids} != transformers {want.tolist()}"
        np.testing.assert_allclose(np.stack(req.logits), logits, atol=LOGIT_ATOL, rtol=0, err_msg=f"{name}: logits")
