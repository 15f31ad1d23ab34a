"""Speculative decoding under DP attention at dp 2 x tp 2 on 8 CPU devices, against Transformers.

``LockstepDPScheduler`` with a draft (``kvjax.dp.speculative``): each rank's scheduler keeps its
proposer (acceptance, rollback and finishing over its own tree and allocator), every rank's paired
prefill runs in one DP program and every rank's speculative round in another, the draft's pool
``kv_draft`` (and EAGLE's hidden-state store) stacked per rank like the target's pools.

* STANDALONE: the tiny Llama target and its one-layer draft of ``tests/serve/test_speculative_parity``
  (the draft shares the target's embedding, first layer and head: rounds mix accepted and rejected
  proposals), page size 1 and 64 tokens per rank: prefix reuse, chunked prefill, eviction,
  retraction and rollback on the ranks together; ranks that prefill while others run a round run
  the two programs one after the other in the same lockstep round.
* STANDALONE with the host tier per rank, the target as its own draft: every proposal is
  accepted, also after prefixes came back from a rank's host pool (the draft's pages ride with
  the target's: ``PairedCopyEngine`` over two ``RankPageTransferEngine``).
* STANDALONE over Gemma 3's hybrid sliding-window pools with its one-layer draft (``test_speculative_swa``'s
  checkpoints: the windows slide past the prompts while rounds roll back; both sides' accounting
  checked on every rank at the end).
* STANDALONE over DeepSeek-V2's MLA latent pools, the target as its own draft: every proposal accepted.
* EAGLE / NEXTN: the tiny DeepSeek-V2 of ``tests/serve/test_speculative_eagle`` with one random MTP
  layer (proposals mostly rejected), page size 1 and a small pool per rank.
* STANDALONE with the ``cpu_tensor`` retraction backup per rank, the target as its own draft:
  retracted requests restored (target and draft pages) on their rank, every proposal accepted.
* EAGLE with a Llama EAGLE head (``LlamaForCausalLMEagle``) over full attention, overlapped.

Each: tokens equal Transformers' greedy ``generate``, the target's logits agree within 1e-4,
both ranks serve requests, every rank's memory balance holds after every round
(``tests.mesh.dp_balance``) and every rank ends leak free.

Overlap scheduling is on (the default) except where a test says otherwise: STANDALONE's and
EAGLE's rounds are chained on the device, each rank's round ``N + 1`` continuing its row of DP
round ``N`` before the host reads it (``overlapped_rounds`` counted on both ranks; the
sliding-window target's SWA slots moved with the full ones); the MLA test runs without overlap (the
plain DP round program).

* the command line: ``generate --dp 2 --tp 4 --speculative-algorithm EAGLE`` gives Transformers'
  tokens, its counters summed over the ranks, with overlap and with ``--disable-overlap-schedule``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from kvjax import CacheConfig
from kvjax.dp import LockstepDPScheduler
from kvjax.dp.speculative import RankDraft, RankDraftDecoding, RankEagleDecoding
from kvjax.serve.checkpoint import load_checkpoint
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import ServingReq
from kvjax.serve.speculative.nextn import nextn_params
from kvjax.transfers.draft_pools import PairedCopyEngine
from tests.mesh.dp_balance import BalancedFront
from tests.mesh.test_dp_host_tier import _rank_prompts
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers, serve_two_rounds
from tests.serve.test_speculative_eagle import LOGIT_ATOL as EAGLE_ATOL
from tests.serve.test_speculative_eagle import MAX_NEW as EAGLE_MAX_NEW
from tests.serve.test_speculative_eagle import checkpoints as checkpoints  # noqa: F401, PLC0414  (the fixtures)
from tests.serve.test_speculative_eagle import deepseek as deepseek  # noqa: F401, PLC0414
from tests.serve.test_speculative_parity import LOGIT_ATOL, MAX_NEW, K
from tests.serve.test_speculative_parity import family as family  # noqa: F401, PLC0414
from tests.serve.test_speculative_swa import MAX_NEW as SWA_MAX_NEW
from tests.serve.test_speculative_swa import check_accounting
from tests.serve.test_speculative_swa import family as swa_family  # noqa: F401  (the fixture)

pytestmark = pytest.mark.mesh

DP, TP = 2, 2


def _front(
    model: Any,
    draft: RankDraft,
    algorithm: str,
    *,
    policy: str = "cache_aware",
    overlap: bool = True,
    **cache_config: Any,
) -> LockstepDPScheduler:
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
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
        draft=draft,
    )


def _serve(front: LockstepDPScheduler, max_new: int) -> dict[str, Any]:
    """The two rounds of ``parity_harness`` with every rank's balance checked after every round;
    both ranks served, each leak free with a sane tree."""
    done = serve_two_rounds(BalancedFront(front), max_new)  # type: ignore[arg-type]
    assert sorted(set(front.rank_of.values())) == [0, 1], front.rank_of
    for scheduler in front.schedulers:
        scheduler.cache.tree_cache.sanity_check()
        assert scheduler.leak_free()
    for leaf in jax.tree.leaves(front.cache.pools):
        assert len(leaf.sharding.device_set) == DP * TP
    return done


def _summed(front: LockstepDPScheduler, field: str, of: str = "stats") -> int:
    return sum(getattr((s.proposer if of == "proposer" else s).stats, field) for s in front.schedulers)


def _assert_overlapped(front: LockstepDPScheduler) -> None:
    """Both ranks chained rounds on the device (each launched before the round it continues was read)."""
    overlapped = [s.proposer.stats.overlapped_rounds for s in front.schedulers]
    assert all(n > 0 for n in overlapped), f"every rank should overlap its rounds: {overlapped}"


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_standalone_reuse_chunked_eviction_retraction_and_rollback(family):
    _, hf, target, draft, _ = family
    front = _front(
        target,
        RankDraft(draft.params, K, spec=draft.spec, config=draft.config),
        "STANDALONE",
        page_size=1,
        max_total_tokens=64,
    )
    assert all(isinstance(s.proposer, RankDraftDecoding) for s in front.schedulers)
    kv_draft = front.cache.pools["kv_draft"]
    assert all(a.sharding.spec[0] == "data" for a in jax.tree.leaves(kv_draft)), "the draft pool is stacked per rank"
    done = _serve(front, MAX_NEW)
    proposed, accepted = _summed(front, "proposed_tokens", "proposer"), _summed(front, "accepted_tokens", "proposer")
    assert 0 < accepted < proposed, f"rounds should mix accepted and rejected proposals: {accepted} of {proposed}"
    assert _summed(front, "rolled_back_slots", "proposer") > 0
    assert _summed(front, "cached_tokens") > 0 and _summed(front, "evicted_tokens") > 0
    assert _summed(front, "retractions") > 0
    assert _summed(front, "prefill_steps") > len(done), "prompts longer than a chunk prefill in chunks"
    assert front.mixed_rounds > 0, "some round should prefill on one rank and draft on the other"
    _assert_overlapped(front)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_standalone_host_tier_per_rank_brings_the_drafts_pages_back(family):
    """Round robin (``test_dp_host_tier``'s stream): each rank's second prompt evicts its first to
    the rank's host pool, the follow-ups load their prefixes back on both ranks, the draft's pages
    with the target's: the target as its own draft still accepts every proposal."""
    _, hf, target, _, target_dir = family
    same = load_checkpoint(target_dir)
    front = _front(
        target,
        RankDraft(same.params, K, spec=same.spec, config=same.config),
        "STANDALONE",
        policy="round_robin",
        page_size=1,
        max_total_tokens=48,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    for scheduler in front.schedulers:
        assert scheduler.cache.draft_host_pool is not None
        engine = scheduler.cache.tree_cache.host.engine
        assert isinstance(engine, PairedCopyEngine)
        rank = scheduler.cache.rank
        assert [(e.pool_name, e.rank) for e in engine.engines] == [("kv", rank), ("kv_draft", rank)]
    p = _rank_prompts()
    balanced = BalancedFront(front)
    done: dict[str, ServingReq] = {}
    for names in (("x0", "y0"), ("x1", "y1"), ("x0+", "y0+")):
        batch = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in names]
        balanced.run(batch)
        done.update((str(r.rid), r) for r in batch)
    assert [front.rank_of[n] for n in ("x0", "y0", "x1", "y1", "x0+", "y0+")] == [0, 1, 0, 1, 0, 1]
    hosts = [next(e for e in s.extensions if isinstance(e, HostTierExtension)) for s in front.schedulers]
    assert [h.loaded_tokens > 0 for h in hosts] == [True, True], "each rank should load a prefix back"
    proposed, accepted = _summed(front, "proposed_tokens", "proposer"), _summed(front, "accepted_tokens", "proposer")
    assert accepted == proposed > 0, f"a draft page did not follow the target's: {accepted} of {proposed}"
    for scheduler, host in zip(front.schedulers, hosts, strict=True):
        scheduler.cache.tree_cache.check_transfers(wait=True)
        assert scheduler.leak_free() and host.host_balanced()
        scheduler.cache.tree_cache.sanity_check()
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


@pytest.mark.parametrize("swa_family", ["gemma3"], indirect=True)
def test_standalone_sliding_window_pools(swa_family):  # noqa: F811  (the fixture)
    """Gemma 3's hybrid sliding-window pools (a serving extension per rank: its SWA page table in
    the verify forward, window freeing before each round, rollback unpairing the SWA slots) with
    its one-layer draft: 12 tokens a request, so every window slides past its prompt."""
    hf, target, draft = swa_family["hf"], swa_family["target"], swa_family["first-layer"]
    front = _front(
        target,
        RankDraft(draft.params, K, spec=draft.spec, config=draft.config),
        "STANDALONE",
        page_size=1,
        max_total_tokens=96,
    )
    done = _serve(front, SWA_MAX_NEW)
    for scheduler in front.schedulers:
        check_accounting(scheduler)
    _assert_overlapped(front)
    proposed, accepted = _summed(front, "proposed_tokens", "proposer"), _summed(front, "accepted_tokens", "proposer")
    assert 0 < accepted < proposed, f"rounds should mix accepted and rejected proposals: {accepted} of {proposed}"
    assert _summed(front, "cached_tokens") > 0
    assert_matches_transformers(hf, done, max_new=SWA_MAX_NEW, atol=LOGIT_ATOL)


def test_eagle_mtp_layer_page_1_evicts_and_retracts(deepseek):
    hf, _, directory, _ = deepseek
    model = load_checkpoint(directory)
    draft = RankDraft(nextn_params(model.config, model.params, directory), K)
    front = _front(model, draft, "NEXTN", page_size=1, max_total_tokens=64)
    assert all(isinstance(s.proposer, RankEagleDecoding) for s in front.schedulers)
    speculation = front.speculation
    assert speculation is not None and speculation.hidden is not None
    assert speculation.hidden.shape[0] == DP and speculation.hidden.sharding.spec[0] == "data"
    done = _serve(front, EAGLE_MAX_NEW)
    proposed, accepted = _summed(front, "proposed_tokens", "proposer"), _summed(front, "accepted_tokens", "proposer")
    assert proposed > 0 and accepted < proposed / 2, f"a random MTP layer's proposals are mostly rejected: {accepted}"
    assert _summed(front, "evicted_tokens") > 0 and _summed(front, "retractions") > 0
    assert _summed(front, "cached_tokens") > 0
    assert _summed(front, "prefill_steps") > len(done), "prompts longer than a chunk prefill in chunks"
    _assert_overlapped(front)
    assert_matches_transformers(hf, done, max_new=EAGLE_MAX_NEW, atol=EAGLE_ATOL)
    # each rank's slice of the store is that rank's: the store rows differ between the ranks
    store = np.asarray(speculation.hidden)
    assert np.abs(store[0]).sum() > 0 and np.abs(store[1]).sum() > 0


def test_standalone_mla_target_as_its_own_draft(deepseek):
    """DeepSeek-V2's MLA latent pools (target's and draft's, each rank's slice whole on its ``"tp"``
    devices, the query heads split) with the target as its own STANDALONE draft: every proposal
    accepted, Transformers' tokens and logits."""
    hf, plain, _, _ = deepseek
    model = load_checkpoint(plain)
    front = _front(
        model,
        RankDraft(model.params, K, spec=model.spec, config=model.config),
        "STANDALONE",
        page_size=16,
        max_total_tokens=512,
        overlap=False,
    )
    kv_draft = front.cache.pools["kv_draft"]
    assert all(a.sharding.shard_shape(a.shape) == (1, *a.shape[1:]) for a in jax.tree.leaves(kv_draft))
    done = _serve(front, EAGLE_MAX_NEW)
    proposed, accepted = _summed(front, "proposed_tokens", "proposer"), _summed(front, "accepted_tokens", "proposer")
    assert accepted == proposed > 0, f"the target as its own draft accepts everything: {accepted} of {proposed}"
    assert_matches_transformers(hf, done, max_new=EAGLE_MAX_NEW, atol=EAGLE_ATOL)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_generate_serves_eagle_at_dp_2_tp_4(deepseek, capsys, overlap):
    """``generate --dp 2 --tp 4 --speculative-algorithm EAGLE`` (the checkpoint's MTP layer) gives
    Transformers' greedy tokens, its acceptance counters summed over the ranks, with overlap
    scheduling (rounds chained on the device) and without."""
    import json

    from kvjax.cli import main
    from tests.serve.parity_harness import hf_greedy, prompts

    hf, _, directory, _ = deepseek
    p = prompts()
    names = ("a", "chat1", "d")
    ids = [",".join(str(t) for t in p[n]) for n in names]
    argv = ["generate", "--model", str(directory), "--max-new-tokens", str(EAGLE_MAX_NEW), "--json", "--page-size", "4"]
    argv += [arg for i in ids for arg in ("--prompt-ids", i)]
    argv += ["--dp", "2", "--tp", "4", "--speculative-algorithm", "EAGLE"]
    argv += [] if overlap else ["--disable-overlap-schedule"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["outputs"] == [hf_greedy(hf, p[n], EAGLE_MAX_NEW)[0] for n in names]
    counters = report["speculative"]
    assert counters["proposed_tokens"] > 0 and counters["algorithm"] == "EAGLE (NEXTN)", counters
    assert (counters["overlapped_rounds"] > 0) == overlap, counters


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_the_cpu_tensor_backup_restores_each_ranks_drafts_pages(family):
    """The ``cpu_tensor`` retraction backup per rank with a draft (overlap on): a retracted
    request's target and draft pages are copied from the rank's slice and restored there on
    re-admission (not recomputed); the target as its own draft still accepts every proposal."""
    from kvjax.serve.retraction_extension import RetractionBackupExtension

    _, hf, target, _, target_dir = family
    same = load_checkpoint(target_dir)
    front = _front(
        target,
        RankDraft(same.params, K, spec=same.spec, config=same.config),
        "STANDALONE",
        page_size=1,
        max_total_tokens=64,
        disaggregation_decode_retraction_backup="cpu_tensor",
    )
    done = _serve(front, MAX_NEW)
    backups = [next(e for e in s.extensions if isinstance(e, RetractionBackupExtension)) for s in front.schedulers]
    assert all(b.retraction.pool_names == ("kv", "kv_draft") for b in backups)
    assert _summed(front, "retractions") > 0
    assert sum(b.retraction.restored for b in backups) > 0, "retracted requests should be restored, not recomputed"
    proposed, accepted = _summed(front, "proposed_tokens", "proposer"), _summed(front, "accepted_tokens", "proposer")
    assert accepted == proposed > 0, f"a draft page did not come back: {accepted} of {proposed}"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_llama_eagle_head_under_dp_attention(tmp_path_factory):
    """A full-attention Llama target with an EAGLE head (SGLang's ``LlamaForCausalLMEagle``) under
    DP attention, overlap on: every rank's head rounds in one DP program, page size 1 and a pool
    small enough to evict; Transformers' tokens and logits, both ranks chaining rounds."""
    from kvjax.serve.speculative.nextn import load_nextn_draft
    from tests.serve.test_eagle_head import _checkpoints

    hf, target_dir, head_dir = _checkpoints(str(tmp_path_factory.mktemp("eagle_head")))
    model = load_checkpoint(target_dir)
    head = load_nextn_draft(head_dir, model)
    front = _front(model, RankDraft(head.params, K), "EAGLE", page_size=1, max_total_tokens=64)
    assert all(isinstance(s.proposer, RankEagleDecoding) for s in front.schedulers)
    done = _serve(front, EAGLE_MAX_NEW)
    assert _summed(front, "proposed_tokens", "proposer") > 0 and _summed(front, "evicted_tokens") > 0
    _assert_overlapped(front)
    assert_matches_transformers(hf, done, max_new=EAGLE_MAX_NEW, atol=EAGLE_ATOL)
