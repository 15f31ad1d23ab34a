"""Recurrent state under decode context parallelism over 8 CPU devices, against Transformers.

The tiny random-weight Qwen3-Next of the tensor-parallel parity tests (gated delta net layers 0, 1
and 3, full attention at layer 2; ``tests/mesh/qwen3_next_tp.py``) under ``--tp T --dcp D``: the
full-attention layer's KV heads over ``T / D`` ranks and its tokens striped over ``D`` (the
allocator's and the tree's page ``page_size * D``), as for the full kind; the recurrent state not
striped but split by heads over the whole TP group of ``T`` devices, ``("tp", "dcp")`` jointly,
as the gated delta net's weights are (``kvjax.plan.kinds.recurrent``). The tree's checkpoints sit
on the striped page's grid, kept by the extra buffer's tracking slots (DCP needs it, as in SGLang).

Served at tp 2 x dcp 2 (page 1 and page 2: trees of 2- and 4-token pages) and tp 4 x dcp 2 through
one cache small enough that the two rounds of ``parity_harness`` start later prompts from
checkpoints, prefill in chunks, evict KV and checkpoints and retract requests (each asserted);
with the ``cpu_tensor`` retraction backup beside the host tier; over 2 pipeline stages of tp 2 x
dcp 2 with two micro-batches; with a STANDALONE draft and with the checkpoint's MTP layer
(rejecting rounds' state restored and replayed, the extra buffer recording a state a round tracked
only within the tokens it keeps); and from ``python -m kvjax generate --tp 4 --dcp 2``, in one
process and over two. Tokens equal Transformers' greedy ``generate``, logits within 1e-4 (2e-4 with the
host tier, as its tp test), no KV, state slot or host slot leaks; what DCP does not serve beside
recurrent state is refused by name. Nemotron-H's Mamba2 mixers are served the same way at tp 2 x
dcp 2.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import pytest
from jax.sharding import PartitionSpec as P

from kvjax import CacheConfig, build_kv_cache
from kvjax.cli import main
from kvjax.errors import ConfigError
from kvjax.mesh_check import make_serving_mesh
from kvjax.plan import plan_kv_cache
from kvjax.pools import MHAKVPool
from kvjax.radix import MambaRadixCache
from kvjax.serve.pipeline_cache import build_pipeline_cache
from kvjax.serve.pipeline_stepping import pipeline_scheduler
from tests.mesh.qwen3_next_tp import HEADS, LAYERS, qwen3_next_checkpoint
from tests.mesh.test_multihost_generate import _lines
from tests.mesh.test_multihost_serving import launch
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    TINY_CONFIG,
    assert_matches_transformers,
    hf_greedy,
    parity_cache_config,
    saved_transformers_model,
    serve_recurrent,
    serve_two_rounds,
    transformers,
)
from tests.serve.test_parity_qwen3_next import MODEL_SEED
from tests.serve.test_recurrent_host_tier import assert_leak_free
from tests.serve.test_recurrent_retraction import MAX_NEW as RETRACTION_MAX_NEW
from tests.serve.test_recurrent_retraction import SMALL, _assert_restored_and_leak_free

pytestmark = pytest.mark.mesh

MAX_NEW = 6
ATOL = 1e-4
DCP = 2
#: A pool small enough to reuse, evict (KV and checkpoints) and retract; the extra buffer's slots.
POOLS: dict[str, Any] = dict(
    max_total_tokens=64, max_running_requests=4, max_mamba_cache_size=12, enable_mamba_extra_buffer=True
)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The model of 2 key heads (tp 2): ``(Transformers model, kvjax's load)``."""
    return qwen3_next_checkpoint(2, tmp_path_factory)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The model of 4 key heads (tp 4)."""
    return qwen3_next_checkpoint(4, tmp_path_factory)


def _mesh(tp: int) -> Any:
    return make_serving_mesh(tp, dcp_size=DCP, devices=jax.devices())


def _checkpoint_depths(tree: MambaRadixCache) -> list[int]:
    """The depth (tokens from the root) of every node holding a recurrent-state checkpoint."""
    depths, stack = [], list(tree.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if tree.mamba.slot_of(node) is not None:
            depths.append(int(node.depth))
    return depths


def _assert_striped_kv_and_state_over_the_group(sched: Any, tp: int, page: int) -> None:
    """The KV striped over ``"dcp"`` (a device holds its rank's ``page`` rows of each striped
    page), the allocator's and the tree's page the striped page, the recurrent state and the gated
    delta net's weights split by heads over all ``tp`` devices (``("tp", "dcp")`` jointly)."""
    assert sched.mesh is not None and dict(sched.mesh.shape) == {"tp": tp // DCP, "dcp": DCP}
    pools = sched.cache.pools
    assert isinstance(pools.kv, MHAKVPool) and pools.kv.context_axis == "dcp"
    assert {shard.data.shape[1] for shard in pools.kv.kv[0].addressable_shards} == {page}
    tree = sched.cache.tree_cache
    assert isinstance(tree, MambaRadixCache)
    assert sched.alloc.page_size == tree.page_size == tree.mamba.checkpoint_grid == page * DCP
    state = pools.recurrent
    assert state.state_axis == ("tp", "dcp")
    for array in state.arrays():
        assert array.sharding.spec == P(None, None, ("tp", "dcp")) and len(array.sharding.device_set) == tp
        assert {shard.data.shape[2] for shard in array.addressable_shards} == {array.shape[2] // tp}
    mixer = sched.params["model"]["layers_0"]["linear_attn"]
    assert mixer["in_proj_qkvz"]["weight"].sharding.spec == P(("tp", "dcp"), None)
    assert mixer["out_proj"]["weight"].sharding.spec == P(None, ("tp", "dcp"))


@pytest.mark.parametrize(("tp", "page"), [(2, 1), (4, 1), (2, 2)], ids=["tp2-page1", "tp4-page1", "tp2-page2"])
def test_qwen3_next_reuse_chunked_prefill_eviction_and_retraction(tp, page, request):
    hf, model = request.getfixturevalue(f"tp{tp}")
    sched, done = serve_recurrent(
        model, MAX_NEW, mesh=_mesh(tp), tp_size=tp, dcp_size=DCP, page_size=page, **POOLS
    )  # asserts no KV or state slot leaked and the tree's sanity
    _assert_striped_kv_and_state_over_the_group(sched, tp, page)
    tree = sched.cache.tree_cache
    depths = _checkpoint_depths(tree)
    assert depths and all(d % (page * DCP) == 0 for d in depths), depths  # the striped page's grid
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert tree.mamba.num_evicted > 0, "the state pool should be small enough to evict checkpoints"
    assert all((done[n].first_cached_tokens or 0) >= 16 for n in ("b", "c", "d")), "from the system prompt's state"
    assert (done["chat2"].first_cached_tokens or 0) >= 16, "turn 2 resumes from a tracked checkpoint of turn 1"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_cpu_tensor_retraction_backup_beside_the_host_tier(tp2):
    """Retracted requests restored from their copies (every device's share of the state slot, the
    striped pages' rows), prefixes and checkpoints evicted to the host and loaded back."""
    hf, model = tp2
    sched, done = serve_recurrent(
        model,
        RETRACTION_MAX_NEW,
        mesh=_mesh(2),
        tp_size=2,
        dcp_size=DCP,
        enable_mamba_extra_buffer=True,
        disaggregation_decode_retraction_backup="cpu_tensor",
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        **dict(SMALL, max_mamba_cache_size=10),
    )
    _assert_striped_kv_and_state_over_the_group(sched, 2, 1)
    _assert_restored_and_leak_free(sched)
    tree = sched.cache.tree_cache
    assert sched.stats.evicted_tokens > 0 and tree.mamba.backups > 0 and tree.mamba.loads > 0
    assert_leak_free(sched)  # the host pools too
    assert_matches_transformers(hf, done, max_new=RETRACTION_MAX_NEW, atol=2e-4)


def test_over_two_pipeline_stages_with_two_micro_batches(tp2):
    """Each stage a tp 2 x dcp 2 group (stage 0: recurrent layers only; stage 1: the attention
    layer, striped, and layer 3's state), the extra buffer's tracked states recorded per
    micro-batch, retracted requests restored from every stage's ``cpu_tensor`` backup."""
    hf, model = tp2
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=1,
        pp_size=2,
        tp_size=2,
        dcp_size=DCP,
        disaggregation_decode_retraction_backup="cpu_tensor",
        **POOLS,
    )
    pipeline = build_pipeline_cache(model.spec, config, devices=jax.devices())
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
    done = serve_two_rounds(sched, MAX_NEW)  # asserts leak free
    for s in range(2):
        assert dict(pipeline.meshes[s].shape) == {"tp": 1, "dcp": DCP}
        assert pipeline.pools(s).recurrent.state_axis == ("tp", "dcp")
    assert pipeline.pools(1).kv.context_axis == "dcp" and sched.alloc.page_size == DCP
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert (done["chat2"].first_cached_tokens or 0) >= 16, "turn 2 resumes from a tracked checkpoint"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def test_generate_at_tp4_dcp2_in_one_process_and_over_two(tmp_path_factory, capsys):
    """``generate --tp 4 --dcp 2`` on the checkpoint (its tree on the striped page: generate sets
    the extra buffer) gives Transformers' greedy tokens, reusing the shared prompt's checkpoint, and
    so do ``--tp 2 --dcp 2`` and ``--dp 2 --tp 8 --dcp 2``;
    over 2 processes of 2 devices (each ``"dcp"`` pair one process's, the state split over all 4)
    the same tokens, every process's state digest compared at every step."""
    config = transformers.Qwen3NextConfig(**TINY_CONFIG, **LAYERS, **HEADS[4])
    hf, directory = saved_transformers_model(config, tmp_path_factory, "qwen3_next_generate", seed=MODEL_SEED)
    shared = list(range(1, 25))
    prompts = [[*shared, 1, 2, 3], [*shared, 7, 8, 9, 10], [40, 41, 42]]
    argv = ["generate", "--model", str(directory), "--tp", "4", "--dcp", "2"]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    argv += ["--max-new-tokens", "4", "--ignore-eos", "--page-size", "1", "--chunked-prefill-size", "8", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["cached_tokens"] >= 16, single  # the second prompt starts from the first one's checkpoint
    assert single["outputs"] == [hf_greedy(hf, p, 4)[0] for p in prompts], single
    for flags in (["--tp", "2"], ["--dp", "2", "--tp", "8"]):  # tp 2 x dcp 2; DP ranks of (2, 2) groups
        assert main([*argv, *flags]) == 0
        assert json.loads(capsys.readouterr().out)["outputs"] == single["outputs"], flags

    out = launch(["--processes", "2", "--cpu-devices-per-process", "2", "--", *argv], timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    printed = _lines(out.stdout, 0)
    assert len(printed) == 1 and json.loads(printed[0]) == single, out.stdout[-2000:]
    digest = hashlib.sha256(json.dumps(single["outputs"]).encode()).hexdigest()[:16]
    status = [line for line in _lines(out.stderr, 1) if "python -m kvjax generate:" in line]
    assert status == [
        "python -m kvjax generate: process 1 of 2 served 3 prompt(s) in step with process 0: 12 tokens "
        f"generated, outputs sha256 {digest} (process 0 prints them)"
    ], out.stderr[-3000:]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            dict(enable_mamba_extra_buffer=False),
            r"dcp_size=2: .*striped page of page_size 1 x 2 = 2 tokens.*set enable_mamba_extra_buffer True",
        ),
        (
            dict(enable_mamba_extra_buffer=True, speculative_algorithm="STANDALONE", pp_size=2),
            r"enable_mamba_extra_buffer=True: speculative decoding of recurrent state with the extra buffer under "
            r"pipeline stages",
        ),
    ],
    ids=["no-extra-buffer", "speculative-over-stages"],
)
def test_what_dcp_does_not_serve_beside_recurrent_state_is_refused_by_name(fields, match, tp2):
    """Refused by the plan, before anything is allocated."""
    _, model = tp2
    config = CacheConfig(**{**dict(POOLS, tp_size=2, dcp_size=DCP, page_size=1, context_length=64), **fields})
    with pytest.raises(ConfigError, match=match):
        plan_kv_cache(model.spec, config, draft_spec=model.spec if config.speculative_algorithm else None)
    if config.pp_size == 1:
        before = len(jax.live_arrays())
        with pytest.raises(ConfigError, match=match):
            build_kv_cache(model.spec, config, mesh=_mesh(2))
        assert len(jax.live_arrays()) == before, "nothing is allocated before the error"


def test_dp_attention_each_rank_a_dcp_group(tp4):
    """``--dp 2 --tp 8 --dcp 2``: each DP rank a group of 4 chips, ``("tp", "dcp")`` = (2, 2), its
    KV heads over ``"tp"`` and its tokens striped over ``"dcp"``, its slice of the stacked state
    split by heads over all 4; the rank's checkpoint forks, copies and ``cpu_tensor`` backup write
    that slice. Both ranks serve, reuse, evict and retract (restored), leak free."""
    from kvjax.dp import LockstepDPScheduler
    from kvjax.serve.retraction_extension import RetractionBackupExtension
    from tests.mesh.dp_balance import BalancedFront

    hf, model = tp4
    dp, tp = 2, 8
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=1,
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=True,
        dcp_size=DCP,
        disaggregation_decode_retraction_backup="cpu_tensor",
        **dict(POOLS, max_total_tokens=40, max_running_requests=8, max_mamba_cache_size=20),
    )
    mesh = make_serving_mesh(tp, dp, True, devices=jax.devices(), dcp_size=DCP)
    front = LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
    )
    done = serve_two_rounds(BalancedFront(front), MAX_NEW)  # type: ignore[arg-type]
    state = front.cache.pools.recurrent
    assert all(tuple(a.sharding.spec)[:4] == ("data", None, None, ("tp", "dcp")) for a in state.arrays())
    rank_view = jax.tree_util.tree_unflatten(front.cache.layout.rank_pools, jax.tree.leaves(front.cache.pools))
    assert rank_view.kv.context_axis == "dcp" and rank_view.recurrent.state_axis == ("tp", "dcp")
    assert sorted(set(front.rank_of.values())) == [0, 1], front.rank_of
    for scheduler in front.schedulers:
        assert scheduler.leak_free() and scheduler.page_size == DCP
        table, tree = scheduler.cache.req_to_token_pool, scheduler.cache.tree_cache
        held = tree.mamba_evictable_size() + tree.mamba_protected_size()
        assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
        tree.sanity_check()
    stats = [s.stats for s in front.schedulers]
    assert sum(st.cached_tokens for st in stats) > 0 and sum(st.evicted_tokens for st in stats) > 0, stats
    assert sum(st.retractions for st in stats) > 0, stats
    backups = [e.retraction for s in front.schedulers for e in s.extensions if isinstance(e, RetractionBackupExtension)]
    assert sum(b.restored for b in backups) > 0 and all(b.held == 0 for b in backups), backups
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def _assert_replayed_and_leak_free(sched: Any) -> None:
    tree, table = sched.cache.tree_cache, sched.cache.req_to_token_pool
    tree.sanity_check()
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    stats = sched.proposer.stats
    assert stats.proposed_tokens > 0 and stats.replayed_requests > 0, stats
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st


def test_standalone_draft_at_tp2_dcp2_replays_and_tracks_the_kept_tokens(tmp_path_factory):
    """A one-layer Qwen3 draft (``tests/serve/test_speculative_recurrent.py``: most rounds reject):
    its pool striped as the target's; each rejecting round's state restored and its kept tokens
    replayed; the extra buffer records a state tracked in a round only within its kept tokens."""
    from kvjax.serve.generate import scheduler_for
    from tests.serve.test_speculative_recurrent import LOGIT_ATOL, K
    from tests.serve.test_speculative_recurrent import models as recurrent_models

    hf, target, draft = recurrent_models.__wrapped__(tmp_path_factory)  # type: ignore[attr-defined]
    config = parity_cache_config(
        page_size=1,
        tp_size=2,
        dcp_size=DCP,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        **dict(POOLS, max_running_requests=8, max_mamba_cache_size=16),
    )
    cache = build_kv_cache(target.spec, config, draft_spec=draft.spec, mesh=_mesh(2))
    assert cache.pools.kv_draft.context_axis == "dcp"
    sched = scheduler_for(
        target, cache, draft=draft, num_steps=K, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    done = serve_two_rounds(sched, MAX_NEW)
    _assert_replayed_and_leak_free(sched)
    assert (done["chat2"].first_cached_tokens or 0) >= 16
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_mtp_layer_at_tp2_dcp2_replays_and_tracks_the_kept_tokens(tmp_path_factory):
    """Qwen3-Next's own MTP layer (random, ``tests/serve/test_qwen3_next_mtp.py``) as the EAGLE /
    NEXTN draft, its pool striped as the target's, the same way."""
    from kvjax.serve.checkpoint import load_checkpoint
    from kvjax.serve.speculative import eagle_scheduler
    from kvjax.serve.speculative.nextn import nextn_params
    from tests.serve.test_eagle_head import K
    from tests.serve.test_qwen3_next_mtp import LOGIT_ATOL, _checkpoints

    hf, _, directory = _checkpoints(str(tmp_path_factory.mktemp("qwen3_next_mtp_dcp")))
    model = load_checkpoint(directory)
    config = parity_cache_config(
        page_size=1,
        tp_size=2,
        dcp_size=DCP,
        speculative_algorithm="NEXTN",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        **dict(POOLS, max_running_requests=8),
    )
    cache = build_kv_cache(model.spec, config, mesh=_mesh(2))
    assert cache.pools.kv_draft.context_axis == "dcp"
    sched = eagle_scheduler(
        model.config,
        cache,
        model.params,
        draft_params=nextn_params(model.config, model.params, directory),
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    done = serve_two_rounds(sched, MAX_NEW)
    _assert_replayed_and_leak_free(sched)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_nemotron_h_mamba2_at_tp2_dcp2(tmp_path_factory):
    """Nemotron-H's Mamba2 mixers (two B/C groups) the same way: the state and the mixers' weights
    split by groups over both devices, the attention layer's KV striped; tokens equal
    Transformers', logits within 1e-4 of its full forward (``tests/serve/test_parity_nemotron_h.py``)."""
    from tests.serve.test_parity_nemotron_h import assert_matches_full_forward, nemotron_h_checkpoint

    hf, model = nemotron_h_checkpoint(tmp_path_factory, "nemotron_h_dcp")
    sched, done = serve_recurrent(model, MAX_NEW, mesh=_mesh(2), tp_size=2, dcp_size=DCP, **POOLS)
    assert sched.cache.pools.kv.context_axis == "dcp" and sched.cache.pools.recurrent.state_axis == ("tp", "dcp")
    mixer = sched.params["backbone"]["layers_0"]["mixer"]
    assert mixer["in_proj"]["weight"].sharding.spec == P(("tp", "dcp"), None)
    assert mixer["out_proj"]["weight"].sharding.spec == P(None, ("tp", "dcp"))
    st = sched.stats
    assert st.cached_tokens > 0 and st.evicted_tokens > 0 and st.retractions > 0, st
    assert_matches_full_forward(hf, done, max_new=MAX_NEW)
