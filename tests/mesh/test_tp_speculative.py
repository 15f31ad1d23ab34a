"""Speculative decoding (STANDALONE) under tensor parallelism, against Hugging Face Transformers (issue 35).

The tiny Llama target and its one-layer draft of ``tests/serve/test_speculative_parity.py`` (the
draft shares the target's embedding, first layer and head, so rounds mix accepted and rejected
proposals) are served over a ``"tp"`` mesh: the target's and the draft's weights split Megatron
style, the target's pool and the draft's ``kv_draft`` pool over the mesh (the checkpoint's 2 KV
heads held twice each at tp 4), both steps jitted with the mesh's shardings and the pools donated.
Every request's tokens equal Transformers' greedy ``generate`` and the target's verify logits
agree within 1e-4, through prefix reuse, a multi-turn chat, chunked prefill, and (page size 1, a
64-token pool) eviction, retraction and roll-back; with the host tier, the target as its own draft
accepts every proposal also after its pages came back from the host.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.serve.generate import scheduler_for
from kvjax.serve.scheduler import ServingReq
from kvjax.serve.speculative import DraftDecoding
from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    assert_matches_transformers,
    prompts,
    serve_two_rounds,
)
from tests.serve.test_speculative_parity import LOGIT_ATOL, MAX_NEW, K
from tests.serve.test_speculative_parity import family as family  # noqa: F401, PLC0414  (the fixture)

pytestmark = pytest.mark.mesh


def _scheduler(target: Any, draft: Any, tp: int, *, page_size: int, max_total_tokens: int, **config: Any) -> Any:
    cache = build_kv_cache(
        target.spec,
        CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=page_size,
            max_total_tokens=max_total_tokens,
            max_running_requests=8,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
            tp_size=tp,
            **config,
        ),
        draft_spec=draft.spec,
        mesh=mesh_of(tp),
    )
    sched = scheduler_for(
        target, cache, draft=draft, num_steps=K, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    assert isinstance(sched.proposer, DraftDecoding)
    assert_sharded(sched, tp)
    return sched


def _serve(target: Any, draft: Any, tp: int, *, page_size: int, max_total_tokens: int, **config: Any) -> Any:
    sched = _scheduler(target, draft, tp, page_size=page_size, max_total_tokens=max_total_tokens, **config)
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    assert sched.leak_free()
    return sched, done


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_tp2_page_16_reuse_multi_turn_chunked(family):
    _, hf, target, draft, _ = family
    sched, done = _serve(target, draft, 2, page_size=16, max_total_tokens=2048)
    stats = sched.proposer.stats
    assert 0 < stats.accepted_tokens < stats.proposed_tokens, f"rounds should mix accepted and rejected: {stats}"
    assert sched.stats.cached_tokens > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_tp4_page_1_evicts_retracts_and_rolls_back(family):
    _, hf, target, draft, _ = family
    sched, done = _serve(target, draft, 4, page_size=1, max_total_tokens=64)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert sched.proposer.stats.rolled_back_slots > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_tp2_host_tier_brings_the_drafts_pages_back(family):
    from kvjax.serve.checkpoint import load_checkpoint
    from kvjax.serve.host_tier import HostTierExtension

    _, hf, target, _, target_dir = family
    same = load_checkpoint(target_dir)  # the target as its own draft: every proposal is accepted
    sched = _scheduler(
        target, same, 2, page_size=1, max_total_tokens=64, enable_hierarchical_cache=True, hicache_ratio=8.0
    )
    # each batch evicts the one before to the host, its host copies landed first (no timing in the
    # test); the chat's second turn then loads its first turn's prefix back
    tree = sched.cache.tree_cache
    p = prompts()
    done: dict[str, ServingReq] = {}
    for names in (("a", "chat1"), ("b", "c"), ("d",)):
        batch = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in names]
        sched.run(batch)
        tree.check_transfers(wait=True)
        done.update((str(r.rid), r) for r in batch)
    chat2 = ServingReq("chat2", p["chat1"] + done["chat1"].output_ids + p["chat2_new"], max_new_tokens=MAX_NEW)
    sched.run([chat2])
    done["chat2"] = chat2
    assert sched.leak_free()
    [ext] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    assert ext.loaded_tokens > 0, "a prefix should have come back from the host"
    assert sched.proposer.stats.acceptance_rate == 1.0, "a draft page did not follow the target's"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_generate_decodes_speculatively_at_tp_2(capsys):
    """``generate --tp 2`` with a STANDALONE draft gives the tokens of ``generate`` without one."""
    import json

    from kvjax.cli import main

    argv = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3,4,5,6,7,8,9", "--max-new-tokens", "6", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    spec = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "tiny", "--tp", "2"]
    assert main([*argv, *spec]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["outputs"] == plain["outputs"]
    assert report["speculative"]["acceptance_rate"] == 1.0  # the target as its own draft
