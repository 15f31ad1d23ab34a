"""Speculative decoding of a recurrent-state target under DP attention, dp 2 x tp 2 on 8 CPU devices.

The target is the tiny Qwen3-Next of ``tests/serve/test_speculative_recurrent`` (3 gated-delta-net
layers and one full-attention layer, float32; its gated delta net's key heads split over each
rank's 2 ``"tp"`` devices); its STANDALONE draft the one-layer Qwen3 with the target's embedding
and head, which agrees now and then, so rounds reject drafts on both ranks. After such a round the
rank restores its requests' states from before the round and replays the kept tokens
(``kvjax.dp.speculative``): the snapshot and restore run on the rank's slice of the stacked state
pool (``kvjax.dp.rank_state_replay``) and the replay forward as a DP step of that rank's batch,
the other rank idle (``LockstepDPScheduler.replay_step``).

Served through the two rounds of ``parity_harness`` (prefix reuse from each rank's state
checkpoints, a multi-turn chat, chunked prefill; the cache-aware router puts ``a``, ``b`` and ``c``
on rank 0, the chat on rank 1) at page size 1 in 44 tokens per rank, small enough to evict the
tree's prefixes (no request is retracted there), overlap scheduling on (the default: a recurrent
target's rounds are read before the next, as on one rank). Each rank replays (``replayed_requests
> 0`` per rank),
every request's tokens equal Transformers' greedy ``generate`` and its logits agree within the
single-rank test's tolerance, every rank's balance holds after every round
(``tests.mesh.dp_balance``) and every rank ends leak free, KV and state slots.

EAGLE / NEXTN with Qwen3-Next's own MTP layer (``tests/serve/test_qwen3_next_mtp``'s random layer:
most rounds reject) is served and checked the same way.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest

from kvjax import CacheConfig
from kvjax.dp import LockstepDPScheduler
from kvjax.dp.speculative import RankDraft, RankDraftDecoding
from kvjax.radix import MambaRadixCache
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.speculative import DraftDecoding
from tests.mesh.dp_balance import BalancedFront
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers, serve_two_rounds
from tests.serve.test_speculative_recurrent import LOGIT_ATOL, MAX_NEW, K
from tests.serve.test_speculative_recurrent import models as models  # noqa: F401, PLC0414  (the fixture)

pytestmark = pytest.mark.mesh

DP, TP = 2, 2
POOL_TOKENS = 44  # per rank: evicts the tree's prefixes (the longest request's last round needs 43)


def _front(target: LoadedModel, draft: RankDraft, algorithm: str, **cache_config: Any) -> LockstepDPScheduler:
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=1,
        max_running_requests=8,
        speculative_algorithm=algorithm,
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        tp_size=DP * TP,
        dp_size=DP,
        enable_dp_attention=True,
        **cache_config,
    )
    mesh = jax.make_mesh((DP, TP), ("data", "tp"), devices=jax.devices()[: DP * TP])
    return LockstepDPScheduler.build_lockstep(
        target.spec,
        config,
        target.params,
        mesh,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        model_config=target.config,
        draft=draft,
    )


def _assert_state_slots_balanced(scheduler: Scheduler, rank: int) -> None:
    table, tree = scheduler.cache.req_to_token_pool, scheduler.cache.tree_cache
    assert isinstance(tree, MambaRadixCache)
    tree.sanity_check()
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, f"rank {rank}: a state slot leaked"


def _proposer(scheduler: Scheduler) -> DraftDecoding:
    assert isinstance(scheduler.proposer, DraftDecoding)
    return scheduler.proposer


def _serve(front: LockstepDPScheduler) -> dict[str, Any]:
    """The two rounds of ``parity_harness``, every rank's balance checked after every round; both
    ranks served and replayed, each leak free (KV and state slots)."""
    done = serve_two_rounds(BalancedFront(front), MAX_NEW)  # type: ignore[arg-type]
    assert sorted(set(front.rank_of.values())) == [0, 1], front.rank_of
    for rank, scheduler in enumerate(front.schedulers):
        assert scheduler.leak_free(), f"rank {rank} leaked"
        _assert_state_slots_balanced(scheduler, rank)
        stats = _proposer(scheduler).stats
        assert stats.replayed_requests > 0 and stats.replayed_tokens > 0, f"rank {rank} never replayed: {stats}"
        assert stats.accepted_tokens < stats.proposed_tokens, stats
    assert front.replay_steps > 0
    return done


def _summed(front: LockstepDPScheduler, field: str) -> int:
    return sum(getattr(s.stats, field) for s in front.schedulers)


def test_standalone_replays_each_ranks_rejected_rounds_through_reuse_and_eviction(models):
    hf, target, draft = models
    front = _front(
        target,
        RankDraft(draft.params, K, spec=draft.spec, config=draft.config),
        "STANDALONE",
        max_total_tokens=POOL_TOKENS,
    )
    assert all(isinstance(s.proposer, RankDraftDecoding) and s.proposer.replays_state for s in front.schedulers)
    done = _serve(front)
    assert _summed(front, "cached_tokens") > 0, "later prompts should start from a rank's state checkpoints"
    assert _summed(front, "evicted_tokens") > 0
    accepted = sum(_proposer(s).stats.accepted_tokens for s in front.schedulers)
    assert accepted > 0, "the draft should agree now and then"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_eagle_mtp_layer_replays_each_ranks_rejected_rounds(tmp_path_factory):
    """Qwen3-Next's own MTP layer (a random one: most rounds reject) as EAGLE / NEXTN: the replay
    runs EAGLE's paired prefill as a DP step (the kept tokens' hidden states rewritten in the
    rank's slice of the store with the same values), the same checks as STANDALONE's."""
    from kvjax.dp.speculative import RankEagleDecoding
    from kvjax.serve.checkpoint import load_checkpoint
    from kvjax.serve.speculative.nextn import nextn_params
    from tests.serve.test_qwen3_next_mtp import LOGIT_ATOL as MTP_ATOL
    from tests.serve.test_qwen3_next_mtp import _checkpoints

    hf, _, directory = _checkpoints(str(tmp_path_factory.mktemp("qwen3_next_mtp_dp")))
    model = load_checkpoint(directory)
    front = _front(
        model, RankDraft(nextn_params(model.config, model.params, directory), K), "NEXTN", max_total_tokens=POOL_TOKENS
    )
    assert all(isinstance(s.proposer, RankEagleDecoding) and s.proposer.replays_state for s in front.schedulers)
    done = _serve(front)
    assert _summed(front, "cached_tokens") > 0 and _summed(front, "evicted_tokens") > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=MTP_ATOL)
