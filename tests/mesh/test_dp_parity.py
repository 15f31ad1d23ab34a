"""DP attention at dp 2 x tp 2 on 8 CPU devices gives Transformers' tokens and logits.

Each family's tiny random-weight checkpoint (the parity tests' own configs, ``tests/serve``) is
served by ``LockstepDPScheduler`` over a ``("data", "tp")`` mesh of 2 x 2 devices: two DP ranks,
each with its own tree, allocator, request table and pool slice, each rank's forward tensor
parallel over its two devices (KV heads and Megatron weights over ``"tp"``), every round one
device step for both ranks. The two rounds of ``parity_harness`` are routed by each policy
(cache-aware and round robin) over pools small enough that, on the ranks together, prefixes are
reused, prompts prefill in chunks, the trees evict and the schedulers retract (each asserted).
Tokens must equal Transformers' greedy ``generate`` and logits agree within 1e-4 (float32);
both ranks serve requests and end leak free; the same stream served cold (radix cache off)
gives the warm run's tokens (Llama and DeepSeek-V2, cache-aware).

Every case runs with overlap scheduling (the lockstep default) except Llama round robin, and the
cold runs of Llama (cache-aware) and Qwen3-Next run without it: the tokens are the same both
ways. Every rank's memory balance is checked after every round (``tests.mesh.dp_balance``). Qwen3 and DeepSeek-V2 run
cache-aware only (DeepSeek-V2's MLA latent pool: a slice per rank, replicated over the rank's
``"tp"`` devices, the query heads split over them), and Gemma 3's sliding-window pools (hybrid
SWA, a serving extension per rank) serve the same way.

Qwen3-Next (gated delta net layers and a full-attention layer; the tp 2 parity model of
``tests/mesh/qwen3_next_tp.py``): each rank's recurrent state in its slice of the stacked state pool,
head parallel over the rank's devices; the checkpoint forks and copies its tree queues are
applied to that slice only (``kvjax.dp.rank_state``, also checked on its own against the copies
done one by one in numpy); no state slot leaks on either rank; cold == warm. Nemotron-H (Mamba2
mixers, the tp test's model) serves the same way, its logits compared with Transformers' full
forward over prompt + output as ``test_tp_parity_nemotron_h`` does.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from kvjax import CacheConfig
from kvjax.dp import LockstepDPScheduler, build_dp_kv_cache
from kvjax.dp.rank_state import RankStateCopies
from kvjax.pools import MLAKVPool
from kvjax.radix.mamba_radix_cache import MambaRadixCache
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.scheduler import ServingReq
from tests.mesh.dp_balance import BalancedFront
from tests.mesh.qwen3_next_tp import HEADS as QWEN3_NEXT_HEADS
from tests.mesh.qwen3_next_tp import LAYERS as QWEN3_NEXT_LAYERS
from tests.serve import random_workloads, swa_parity
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    TINY_CONFIG,
    assert_matches_transformers,
    serve_two_rounds,
    tiny_checkpoint,
    transformers,
)
from tests.serve.test_parity_deepseek_v2 import CONFIG as DEEPSEEK_V2
from tests.serve.test_parity_gemma3 import CONFIG as GEMMA3
from tests.serve.test_parity_nemotron_h import assert_matches_full_forward, nemotron_h_checkpoint
from tests.serve.test_parity_qwen3_next import MODEL_SEED as QWEN3_NEXT_SEED
from tests.serve.test_parity_transformers import COMMON, FAMILIES

DP, TP = 2, 2
MAX_NEW = 6
ATOL = 1e-4
POOL_TOKENS = 48  # per rank: small enough to evict and retract on a rank
# recurrent models, per rank: KV tokens and state slots small enough to evict and retract
RECURRENT_POOLS = dict(max_total_tokens=42, max_running_requests=8, max_mamba_cache_size=12)


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, tuple[Any, LoadedModel]]:
    """Built on first use per family: ``(Transformers model, kvjax's load)``."""
    return {}


def _checkpoint(name: str, checkpoints: dict, tmp_path_factory) -> tuple[Any, LoadedModel]:
    if name not in checkpoints:
        if name == "gemma3":
            config = transformers.Gemma3TextConfig(**GEMMA3)
        elif name == "deepseek_v2":
            config = transformers.DeepseekV2Config(**DEEPSEEK_V2)
        else:
            cls, extra = FAMILIES[name]
            config = getattr(transformers, cls)(**COMMON, **extra)
        checkpoints[name] = tiny_checkpoint(config, tmp_path_factory, name)
    return checkpoints[name]


def _front(model: LoadedModel, policy: str, *, overlap: bool = True, **cache_config: Any) -> LockstepDPScheduler:
    settings: dict[str, Any] = dict(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=1,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
    )
    config = CacheConfig(**{**settings, **cache_config})
    mesh = jax.make_mesh((DP, TP), ("data", "tp"), devices=jax.devices()[: DP * TP])
    return LockstepDPScheduler.build_lockstep(
        model.spec,
        config,
        model.params,
        mesh,
        policy=policy,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=model.config,
        overlap=overlap,
    )


def _serve(front: LockstepDPScheduler, max_new: int) -> dict[str, ServingReq]:
    """``serve_two_rounds`` on ``front``, every rank's balance checked after every round."""
    return serve_two_rounds(BalancedFront(front), max_new)  # type: ignore[arg-type]


def _assert_served_by_both_ranks_leak_free(front: LockstepDPScheduler) -> None:
    assert sorted(set(front.rank_of.values())) == [0, 1], front.rank_of
    assert [s.leak_free() for s in front.schedulers] == [True, True]
    rank_steps = [s.stats.prefill_steps + s.stats.decode_steps for s in front.schedulers]
    # lockstep: a device step runs every rank's batch of its round, so ranks share steps
    assert max(rank_steps) <= front.dp_steps < sum(rank_steps), (front.dp_steps, rank_steps)
    for leaf in jax.tree.leaves(front.cache.pools):
        assert len(leaf.sharding.device_set) == DP * TP


def _outputs(done: dict[str, ServingReq]) -> dict[str, list[int]]:
    return {name: list(req.output_ids) for name, req in done.items()}


@pytest.mark.parametrize(
    ("family", "policy"),
    [("llama", "cache_aware"), ("llama", "round_robin"), ("qwen3", "cache_aware"), ("deepseek_v2", "cache_aware")],
)
def test_reuse_chunked_prefill_eviction_and_retraction(family, policy, checkpoints, tmp_path_factory):
    hf, model = _checkpoint(family, checkpoints, tmp_path_factory)
    front = _front(model, policy, overlap=(family, policy) != ("llama", "round_robin"))
    done = _serve(front, MAX_NEW)
    assert [s.overlap for s in front.schedulers] == [front.overlap] * DP
    _assert_served_by_both_ranks_leak_free(front)
    if family == "deepseek_v2":  # the MLA latent: a slice per rank, whole on each of the rank's devices
        kv = front.cache.pools.kv
        assert isinstance(kv, MLAKVPool)
        assert all(a.sharding.shard_shape(a.shape) == (1, *a.shape[1:]) for a in kv.kv)
    stats = [s.stats for s in front.schedulers]
    assert sum(st.cached_tokens for st in stats) > 0, stats
    assert sum(st.evicted_tokens for st in stats) > 0, stats
    assert sum(st.retractions for st in stats) > 0, stats
    assert sum(st.prefill_steps for st in stats) > len(done), "prompts longer than a chunk prefill in chunks"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
    if policy == "cache_aware" and family in ("llama", "deepseek_v2"):  # cold == warm (each run compiles the step)
        cold = _front(model, policy, overlap=family != "llama", disable_radix_cache=True)
        cold_done = _serve(cold, MAX_NEW)
        assert cold.cached_tokens == 0
        assert _outputs(cold_done) == _outputs(done)
        assert [s.leak_free() for s in cold.schedulers] == [True, True]


def test_gemma3_sliding_window_pools(checkpoints, tmp_path_factory):
    hf, model = _checkpoint("gemma3", checkpoints, tmp_path_factory)
    front = _front(model, "cache_aware", max_total_tokens=64)
    done = _serve(front, swa_parity.MAX_NEW)
    _assert_served_by_both_ranks_leak_free(front)
    assert front.cached_tokens > 0
    assert_matches_transformers(hf, done, max_new=swa_parity.MAX_NEW, atol=swa_parity.LOGIT_ATOL)


def _serve_recurrent(
    model: LoadedModel, *, overlap: bool = True, **cache_config: Any
) -> tuple[LockstepDPScheduler, dict[str, ServingReq]]:
    """The two rounds on a recurrent-state model over ``RECURRENT_POOLS``; asserts both ranks
    served, the state pool's layout, no state slot leaked and the tree sane on each rank."""
    front = _front(model, "cache_aware", overlap=overlap, **RECURRENT_POOLS, **cache_config)
    done = _serve(front, MAX_NEW)
    _assert_served_by_both_ranks_leak_free(front)
    state = front.cache.pools.recurrent
    assert all(a.sharding.spec[0] == "data" and a.sharding.spec[3] == "tp" for a in (*state.conv, state.ssm))
    for scheduler in front.schedulers:
        table, tree = scheduler.cache.req_to_token_pool, scheduler.cache.tree_cache
        held = tree.mamba_evictable_size() + tree.mamba_protected_size() if isinstance(tree, MambaRadixCache) else 0
        assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
        if isinstance(tree, MambaRadixCache):
            tree.sanity_check()
    return front, done


def _assert_reused_evicted_retracted(front: LockstepDPScheduler, done: dict[str, ServingReq]) -> None:
    assert sum(s.cache.pending.applied for s in front.schedulers) > 0, "no checkpoint fork or copy ran"
    stats = [s.stats for s in front.schedulers]
    assert sum(st.cached_tokens for st in stats) > 0, stats
    assert sum(st.evicted_tokens for st in stats) > 0, stats
    assert sum(st.retractions for st in stats) > 0, stats
    assert sum(st.prefill_steps for st in stats) > len(done), "prompts longer than a chunk prefill in chunks"


def test_qwen3_next_recurrent_state_per_rank(tmp_path_factory):
    """Gated delta net layers: each rank's state slots in its slice of the stacked state pool
    (state heads over the rank's ``"tp"`` devices); checkpoint forks and copies write that slice.
    Retracted requests are restored from the ``cpu_tensor`` backup: each rank's KV pages and state
    rows copied from its slice and written back into it (the cold run recomputes them)."""
    from kvjax.serve.retraction_extension import RetractionBackupExtension

    config = transformers.Qwen3NextConfig(**TINY_CONFIG, **QWEN3_NEXT_LAYERS, **QWEN3_NEXT_HEADS[TP])
    hf, model = tiny_checkpoint(config, tmp_path_factory, "qwen3_next", seed=QWEN3_NEXT_SEED)
    front, done = _serve_recurrent(model, disaggregation_decode_retraction_backup="cpu_tensor")
    _assert_reused_evicted_retracted(front, done)
    backups = [e.retraction for s in front.schedulers for e in s.extensions if isinstance(e, RetractionBackupExtension)]
    assert [b.pool_names for b in backups] == [("kv", "recurrent")] * DP
    assert sum(b.restored for b in backups) > 0, "a re-admitted request should be restored"
    assert all(b.held == 0 for b in backups)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)
    cold, cold_done = _serve_recurrent(model, overlap=False, disable_radix_cache=True)
    assert cold.cached_tokens == 0
    assert _outputs(cold_done) == _outputs(done)


def test_nemotron_h_mamba2_state_per_rank(tmp_path_factory):
    """Mamba2 mixers (two B/C groups) per rank, head parallel over its devices: Transformers'
    greedy tokens, logits against its full forward over prompt + output (as the tp test)."""
    hf, model = nemotron_h_checkpoint(tmp_path_factory, "nemotron_h")
    front, done = _serve_recurrent(model)
    _assert_reused_evicted_retracted(front, done)
    assert_matches_full_forward(hf, done, max_new=MAX_NEW)


def test_rank_state_copies_write_only_their_rank_slice():
    """A rank's queued state copies (in order, a chain among them) land in its slice of every
    state array (slot axis 2 of ``[rank, layer, slot, ...]``); the other rank's slice is untouched."""
    spec, _, _ = random_workloads.model("qwen3-next-tiny")
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        page_size=1,
        max_total_tokens=POOL_TOKENS,
        max_running_requests=8,
        max_mamba_cache_size=12,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
    )
    mesh = jax.make_mesh((DP, TP), ("data", "tp"), devices=jax.devices()[: DP * TP])
    cache = build_dp_kv_cache(spec, config, mesh)
    rng = np.random.default_rng(0)
    state = jax.tree.map(
        lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding), cache.pools.recurrent
    )
    before = [np.asarray(a) for a in jax.tree.leaves(state)]
    assert all(a.shape[2] > 6 for a in before), [a.shape for a in before]  # slots 1..6 exist on each rank
    copies = [(1, 2), (3, 4), (2, 5), (6, 1)]  # 2 -> 5 reads the first copy's result
    update = RankStateCopies(cache.layout).update(1, copies)
    assert list(update.pages) == [2, 4, 5, 1]
    after = [np.asarray(a) for a in jax.tree.leaves(update.apply(cache.pools.replace(recurrent=state)).recurrent)]
    for old, new in zip(before, after, strict=True):
        expected = old.copy()
        for src, dst in copies:
            expected[1, :, dst] = expected[1, :, src]
        np.testing.assert_array_equal(new, expected)
