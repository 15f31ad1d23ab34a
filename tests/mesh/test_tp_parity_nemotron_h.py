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

import pytest
from jax.sharding import PartitionSpec as P

from tests.mesh.tp_serving import serve_recurrent_over_tp
from tests.serve.test_parity_nemotron_h import assert_matches_full_forward, nemotron_h_checkpoint

MAX_NEW = 6
TP = 2


@pytest.mark.timeout(600)  # ~2 min on a quiet machine; shared CPUs stretch it
def test_head_parallel_mamba2_reuse_eviction_and_retraction(tmp_path_factory):
    hf, model = nemotron_h_checkpoint(tmp_path_factory, "nemotron_h_tp")
    sched, done = serve_recurrent_over_tp(model, MAX_NEW, TP)
    mixer = sched.params["backbone"]["layers_0"]["mixer"]
    assert mixer["in_proj"]["weight"].sharding.spec == P("tp", None)
    assert mixer["conv1d"]["weight"].sharding.spec == P("tp", None, None)
    assert mixer["out_proj"]["weight"].sharding.spec == P(None, "tp")
    assert mixer["norm"]["weight"].sharding.spec == P("tp") and mixer["D"].sharding.spec == P("tp")
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_full_forward(hf, done, max_new=MAX_NEW)
