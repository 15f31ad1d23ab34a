"""Tensor parallelism over 8 CPU devices gives Transformers' tokens and logits.

Each family's tiny random-weight checkpoint (the parity tests' own configs, ``tests/serve``) is
served with its pools sharded over a ``"tp"`` mesh axis of 2 and 4 devices and its weights split
Megatron style (``kvjax.serve.param_sharding``), through one cache small enough that the two rounds
of ``parity_harness`` reuse prefixes, prefill in chunks, evict and retract (each asserted). At tp 4
the tiny models' 2 KV heads are replicated (each rank holds one); a Llama with 8 query heads runs
at tp 8 (Qwen3-Next: ``test_tp_parity_qwen3_next.py``). Tokens must equal Transformers' greedy ``generate`` and logits
agree within each family's tolerance; the cache ends leak free.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvjax.pools import MHAKVPool, MLAKVPool
from kvjax.serve.checkpoint import LoadedModel
from tests.mesh.tp_serving import assert_sharded, family_checkpoint, mesh_of
from tests.serve import swa_parity
from tests.serve.parity_harness import assert_matches_transformers, build_scheduler, serve_two_rounds

MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Any, LoadedModel]]:
    """Built on first use per family: ``(Transformers model, kvjax's load)``."""
    return {}


def _checkpoint(name: str, checkpoints: dict, tmp_path_factory) -> tuple[Any, LoadedModel]:
    if name not in checkpoints:
        checkpoints[name] = family_checkpoint(name, tmp_path_factory)
    return checkpoints[name]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gqa_reuse_chunked_prefill_eviction_and_retraction(family, tp, checkpoints, tmp_path_factory):
    hf, model = _checkpoint(family, checkpoints, tmp_path_factory)
    sched = build_scheduler(
        model, mesh=mesh_of(tp), tp_size=tp, page_size=1, max_total_tokens=64, max_running_requests=8
    )
    done = serve_two_rounds(sched, MAX_NEW)
    assert isinstance(sched.cache.pools.kv, MHAKVPool) and sched.cache.pools.kv.num_kv_heads == max(2, tp)
    assert_sharded(sched, tp)
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_llama_at_tp_8_with_8_query_heads_over_2_kv_heads(tmp_path_factory):
    """Every device of the mesh: one query head per rank, each of the 2 KV heads stored on 4 ranks."""
    hf, model = family_checkpoint("llama", tmp_path_factory, label="llama8", num_attention_heads=8)
    sched = build_scheduler(model, mesh=mesh_of(8), tp_size=8, page_size=1, max_total_tokens=64, max_running_requests=8)
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.cache.pools.kv.num_kv_heads == 8
    assert_sharded(sched, 8)
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_gemma3_sliding_window_pools(tp, checkpoints, tmp_path_factory):
    hf, model = _checkpoint("gemma3", checkpoints, tmp_path_factory)
    sched, done = swa_parity.serve(model, page_size=1, max_total_tokens=64, mesh=mesh_of(tp), tp_size=tp)
    assert_sharded(sched, tp)
    evicted = sched.evicted_per_pool  # type: ignore[attr-defined]
    assert sched.stats.cached_tokens > 0 and evicted["full"] > 0 and evicted["swa"] > 0
    assert sched.stats.retractions > 0
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_deepseek_v2_mla_latent_replicated_heads_split(tp, checkpoints, tmp_path_factory):
    hf, model = _checkpoint("deepseek_v2", checkpoints, tmp_path_factory)
    sched = build_scheduler(
        model, mesh=mesh_of(tp), tp_size=tp, page_size=1, max_total_tokens=64, max_running_requests=8
    )
    done = serve_two_rounds(sched, MAX_NEW)
    kv = sched.cache.pools.kv
    assert isinstance(kv, MLAKVPool) and all(a.sharding.is_fully_replicated for a in kv.kv)
    assert_sharded(sched, tp)
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
