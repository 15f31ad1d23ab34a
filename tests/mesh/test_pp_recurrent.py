"""Qwen3-Next over pipeline stages on 8 CPU devices gives Transformers' tokens and logits.

The tiny random-weight Qwen3-Next of the tensor-parallel parity tests (gated delta net layers 0,
1 and 3, full attention at layer 2; ``tests/mesh/qwen3_next_tp.py``) is served over 2 stages of
one device (retracted requests recomputed) and of 2 TP devices (retracted requests restored from
the ``cpu_tensor`` backup of every stage's pages and state rows), with two micro-batches and
overlap scheduling: stage 0 holds
layers 0 and 1 (recurrent state only, no token pool), stage 1 layers 2 and 3 (KV and state), so
every stage holds recurrent state and each state fork and checkpoint must reach both. The cache
is small enough (56 tokens, 4 running requests, 6 state slots) that the two rounds of
``parity_harness`` start later prompts from a forked checkpoint, prefill in chunks, evict KV and
checkpoints and retract requests (each asserted). Tokens must equal Transformers' greedy
``generate`` and logits agree within 1e-4 (float32); no KV or state slot leaks; each stage's
arrays lie on its own devices and serve its own layers; every stage plans the same state slots.

Also: a first stage of full-attention layers only (no state of its own) gets the stages' state
extension, recording on the stage that holds state; what is not served over stages (the host
tier of these models, DP attention) is refused by name. The extra buffer with two micro-batches
(its tracked states recorded per micro-batch) is served over stages under decode context
parallelism: ``tests/mesh/test_dcp_recurrent.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest

from kvjax import CacheConfig
from kvjax.dp.pipeline import check_dp_pipeline_config
from kvjax.errors import ConfigError
from kvjax.plan import plan_kv_cache
from kvjax.radix import MambaRadixCache
from kvjax.serve.model import init_params
from kvjax.serve.model_config import model_config_from_spec
from kvjax.serve.pipeline_cache import build_pipeline_cache
from kvjax.serve.pipeline_retraction import StagedRetractionBackup
from kvjax.serve.pipeline_stepping import pipeline_scheduler
from kvjax.serve.recurrent_extension import RecurrentStateExtension
from kvjax.serve.retraction_extension import RetractionBackupExtension
from kvjax.serve.scheduler import Scheduler
from kvjax.spec import ModelSpec
from tests.mesh.qwen3_next_tp import qwen3_next_checkpoint
from tests.mesh.test_pp_parity import assert_stages_hold_their_own
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers, serve_two_rounds
from tests.serve.random_workloads import QWEN3_NEXT_TINY

MAX_NEW = 6
ATOL = 1e-4
LAYERS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The tp 2 model (2 key heads, so it also runs at tp 2): ``(Transformers model, kvjax's load)``."""
    return qwen3_next_checkpoint(2, tmp_path_factory)


def _config(pp: int, tp: int, **fields: Any) -> CacheConfig:
    return CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=1,
        max_total_tokens=56,
        max_running_requests=4,
        max_mamba_cache_size=6,
        pp_size=pp,
        tp_size=tp,
        **fields,
    )


def _serve(model: Any, pp: int, tp: int, **fields: Any) -> tuple[Scheduler, dict[str, Any]]:
    pipeline = build_pipeline_cache(model.spec, _config(pp, tp, **fields), devices=jax.devices())
    sched = pipeline_scheduler(
        model.config,
        pipeline,
        model.params,
        micro_batches=2,
        overlap=True,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    return sched, serve_two_rounds(sched, MAX_NEW)  # asserts the KV leak free


def _assert_state_slots_leak_free(sched: Scheduler) -> None:
    table = sched.cache.req_to_token_pool
    tree = sched.cache.tree_cache
    assert isinstance(tree, MambaRadixCache)
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    tree.sanity_check()


@pytest.mark.parametrize(
    ("pp", "tp", "backup"), [(2, 1, None), (2, 2, "cpu_tensor")], ids=["pp2-recompute", "pp2-tp2-cpu_tensor"]
)
def test_qwen3_next_reuse_chunked_prefill_eviction_and_retraction(pp, tp, backup, checkpoint):
    """``backup``: the retracted requests recompute (None) or are restored from the ``cpu_tensor``
    backup of every stage, each stage's KV pages and state rows (the request's checkpoint forked
    into its new slot first, then replaced by its own state)."""
    hf, model = checkpoint
    fields = {} if backup is None else {"disaggregation_decode_retraction_backup": backup}
    sched, done = _serve(model, pp, tp, **fields)
    _assert_state_slots_leak_free(sched)
    assert_stages_hold_their_own(sched, LAYERS)
    pipe = sched.stepping.pipeline  # type: ignore[attr-defined]
    for s, expected in enumerate(((0, 1), (3,))):  # each stage's recurrent layers hold their state there
        state = pipe.pools(s).recurrent
        assert tuple(state.layer_ids) == expected
        assert state.ssm.shape[1] == 6 + 1, "every stage holds the planned state slots and the padding slot"
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert (done["chat2"].first_cached_tokens or 0) > 0, "turn 2 starts from a forked checkpoint"
    if backup is not None:
        [ext] = [e for e in sched.extensions if isinstance(e, RetractionBackupExtension)]
        staged = ext.retraction
        assert isinstance(staged, StagedRetractionBackup)
        assert [p.target for p in staged.stages[0].parts] == ["recurrent"], "stage 0: state rows only"
        assert [p.target for p in staged.stages[1].parts] == ["kv", "recurrent"]
        assert staged.restored > 0 and all(b.restored == staged.restored for b in staged.stages), staged.stages
        assert staged.held == 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_every_stage_plans_the_same_state_slots(checkpoint):
    """With the slots sized from a byte budget, the stage with fewer recurrent layers would hold
    more: every stage gets the fewest (one state allocator drives them all)."""
    _, model = checkpoint
    config = CacheConfig(context_length=CONTEXT_LENGTH, pp_size=2, memory_budget_bytes=1 << 20)
    one = plan_kv_cache(model.spec, config.replace(pp_size=1))
    plans = [plan_kv_cache(model.spec, config.replace(pp_rank=s)) for s in range(2)]
    slots = [int(p.max_mamba_cache_size or 0) for p in plans]
    assert slots[0] == slots[1], slots
    # stage 0's two recurrent layers take the set-aside bytes: more slots than three layers' at pp 1
    assert slots[0] > int(one.max_mamba_cache_size or 0) > 0, (slots, one.max_mamba_cache_size)


@pytest.mark.parametrize(
    ("fields", "option"),
    [
        ({"enable_hierarchical_cache": True}, "enable_hierarchical_cache"),
        ({"enable_dp_attention": True, "dp_size": 2, "tp_size": 2}, "enable_dp_attention"),
    ],
)
def test_what_is_not_served_over_stages_is_refused_by_name(fields, option, checkpoint):
    """The host tier (its checkpoints' host copies) and DP attention over stages are refused,
    naming the option, before anything is built."""
    _, model = checkpoint
    config = _config(2, fields.get("tp_size", 1), **{k: v for k, v in fields.items() if k != "tp_size"})
    check = check_dp_pipeline_config if config.enable_dp_attention else build_pipeline_cache
    with pytest.raises(ConfigError, match=option) as refused:
        check(model.spec, config)
    assert refused.value.option == option


def test_a_first_stage_without_recurrent_layers_records_the_copies_on_the_others():
    """Stage 0 of full-attention layers holds no state, so its cache builds no state extension:
    the stages' one is put first among the scheduler's extensions, over stage 0's request table
    and tree, recording the tree's copies on the stage that holds state only."""
    layers = ["full_attention", "full_attention", "linear_attention", "full_attention"]
    spec = ModelSpec.from_hf_config(dict(QWEN3_NEXT_TINY, layer_types=layers), name="qwen3-next-full-first")
    config = model_config_from_spec(spec)
    pipeline = build_pipeline_cache(spec, _config(2, 1), devices=jax.devices())
    assert "recurrent" not in pipeline.pools(0) and "recurrent" in pipeline.pools(1)
    assert pipeline.cache.req_to_token_pool.mamba_pool_size == 6, "stage 0's table holds every stage's slots"
    sched = pipeline_scheduler(config, pipeline, init_params(config), micro_batches=2, max_batch_size=4)
    found = [e for e in sched.extensions if isinstance(e, RecurrentStateExtension)]
    assert len(found) == 1 and sched.extensions[0] is found[0]
    assert found[0].queues == (pipeline.pending[1],)
