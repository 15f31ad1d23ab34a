"""Speculative decoding (STANDALONE) over sliding-window caches, against Hugging Face Transformers.

The targets are the tiny random-weight checkpoints of the sliding-window parity tests: gpt-oss
(sliding, full, sliding, full; window 8) and Gemma 3 (sliding, sliding, full, sliding; window 8),
served with the hybrid SWA pools (a full pool, an SWA pool, the SWA allocator and the SWA tree),
and Mistral with the window on both layers (a pure sliding-window cache: one SWA pool, its slots
freed as they leave the window). The draft's pool ``"kv_draft"`` is indexed by the allocator's
slots; the draft's own sliding layers mask it on global positions (``kvjax.plan.draft``).

The harness's two rounds (``parity_harness.serve_two_rounds``: prompts of 24 to 35 tokens, three
windows, chunked prefill of 8, prefix reuse across the window, a multi-turn chat) decode 12
tokens per request, so every window slides past its prompt and decode frees SWA slots while the
rounds roll rejected tokens back. Every request's tokens equal Transformers' greedy ``generate``
and its logits (the target's, from the verify forwards) agree within ``LOGIT_ATOL``; the token
accounting of both sides holds after every step (``check_accounting``: ``available + evictable +
protected + held == capacity``, the SWA side counting the pages still paired through the full→SWA
mapping) and the cache is leak free after.

* the target as its own draft accepts every proposal (page 4, roomy pool), and warm (every prompt
  cached) gives the cold tokens;
* a one-layer draft with the target's embedding, first (sliding) layer and head agrees part of the
  time (rounds mix accepted and rejected tokens), at page 1 with pools small enough to evict from
  both sides and to retract;
* an unrelated draft (its own random weights) still gives the exact tokens;
* the pure sliding-window Mistral with the one-layer draft, at page 1 with a small pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache, plan_kv_cache
from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.errors import ConfigError
from kvjax.radix import PureSWARadixCache, SWARadixCache
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint
from kvjax.serve.generate import scheduler_for
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative import DraftDecoding
from kvjax.serve.swa_extension import SWAServing
from tests.serve.parity_harness import (
    CHUNK,
    assert_matches_transformers,
    parity_cache_config,
    prompts,
    random_transformers_model,
    save_pretrained,
    serve_two_rounds,
    torch,
    transformers,
)
from tests.serve.test_parity_gemma3 import CONFIG as GEMMA3_CONFIG
from tests.serve.test_parity_gpt_oss import CONFIG as GPT_OSS_CONFIG
from tests.serve.test_parity_mistral_swa import CONFIG as MISTRAL_CONFIG
from tests.serve.test_parity_mistral_swa import PROMPT_SEED as MISTRAL_PROMPT_SEED

LOGIT_ATOL = 1e-4
MAX_NEW = 12
LONG = 24  # tokens decoded where every proposal is accepted: rounds of k + 1 tokens must still pass the window
K = 3  # draft tokens per round

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_oss": ("GptOssConfig", GPT_OSS_CONFIG),
    "gemma3": ("Gemma3TextConfig", GEMMA3_CONFIG),
}


def _one_layer(config: dict[str, Any]) -> dict[str, Any]:
    """The config with the first layer only (its kind kept: sliding in every family here)."""
    one = dict(config, num_hidden_layers=1)
    if "layer_types" in config:
        one["layer_types"] = config["layer_types"][:1]
    return one


def _checkpoints(class_name: str, config: dict[str, Any], tmp_path_factory: Any, name: str) -> dict[str, Any]:
    """The Transformers target and kvjax's loads of: the target, a one-layer draft sharing the
    target's embedding, first layer, final norm and head, and an unrelated one-layer draft."""
    config_class = getattr(transformers, class_name)
    hf = random_transformers_model(config_class(**config))
    target_dir = save_pretrained(hf, tmp_path_factory, name)
    with torch.no_grad():
        first = random_transformers_model(config_class(**_one_layer(config)), seed=1)
        missing, _ = first.load_state_dict(hf.state_dict(), strict=False)
        assert not missing, f"the draft should take every weight from the target; missing {missing}"
        unrelated = random_transformers_model(config_class(**_one_layer(config)), seed=7)
    return {
        "hf": hf,
        "target": load_checkpoint(target_dir),
        "first-layer": load_checkpoint(save_pretrained(first, tmp_path_factory, f"{name}-first-layer")),
        "unrelated": load_checkpoint(save_pretrained(unrelated, tmp_path_factory, f"{name}-unrelated")),
        "dir": target_dir,
    }


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> dict[str, Any]:
    class_name, config = FAMILIES[request.param]
    return _checkpoints(class_name, config, tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> dict[str, Any]:
    return _checkpoints("MistralConfig", MISTRAL_CONFIG, tmp_path_factory, "mistral")


# --- the accounting ---------------------------------------------------------------------------


def _held(sched: Scheduler, paired: Any) -> int:
    """Token slots the live requests hold of their own (page-rounded ``[cache_protected_len,
    kv_len)``, or with overlap up to the proposer's ``allocated_len``), counting only pages whose
    first slot ``paired(slots)`` says is still live."""
    ps, table = sched.page_size, sched.rows.req_to_token
    allocated = getattr(sched.proposer, "allocated_len", ServingReq.kv_len)  # overlap: a round's reserve
    held = 0
    for req in sched.live_requests():
        if req.req_pool_idx is None:
            continue
        end = -(-allocated(req) // ps) * ps
        slots = table[req.req_pool_idx, req.cache_protected_len : end : ps]
        held += int(np.count_nonzero(paired(slots))) * ps
    return held


def check_accounting(sched: Scheduler) -> None:
    """``available + evictable + protected + held == capacity`` on every side of a sliding-window
    cache (after every step): the full side counts a request's page-rounded KV, the SWA side only
    its pages still paired (window freeing and rollback unpair them); pure: the request table's
    slots not yet zeroed by window freeing."""
    alloc, tree = sched.alloc, sched.tree
    alloc.check_invariants()
    tree.sanity_check()
    if isinstance(alloc, SWATokenToKVPoolAllocator):
        assert isinstance(tree, SWARadixCache)
        full = alloc.full_available_size() + tree.full_evictable_size() + tree.full_protected_size()
        full += _held(sched, lambda s: s > 0)
        assert full == alloc.size_full, f"full side: {full} accounted of {alloc.size_full}"
        mapping = alloc.full_to_swa_index_mapping
        swa = alloc.swa_available_size() + tree.swa_evictable_size() + tree.swa_protected_size()
        swa += _held(sched, lambda s: mapping[s] > 0)
        assert swa == alloc.size_swa, f"SWA side: {swa} accounted of {alloc.size_swa}"
    else:
        assert isinstance(tree, PureSWARadixCache)
        swa = alloc.available_size() + tree.evictable_size() + tree.protected_size() + _held(sched, lambda s: s > 0)
        assert swa == alloc.size, f"SWA pool: {swa} accounted of {alloc.size}"


def _checked_every_step(sched: Scheduler) -> None:
    step = sched.step

    def checked() -> list[ServingReq]:
        done = step()
        check_accounting(sched)
        return done

    sched.step = checked  # type: ignore[method-assign]


def _count_evictions(sched: Scheduler) -> dict[str, int]:
    """Tokens evicted per side (``"full"``, ``"swa"``) by every eviction the loop asks the tree for."""
    tree = sched.tree
    evict = tree.evict
    evicted = {"full": 0, "swa": 0}

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = evict(*args, **kwargs)
        if isinstance(out, dict):
            for side in evicted:
                evicted[side] += out.get(side, 0)
        return out

    tree.evict = recording  # type: ignore[method-assign]
    return evicted


# --- serving ----------------------------------------------------------------------------------


def spec_scheduler(
    target: LoadedModel,
    draft: LoadedModel,
    *,
    page_size: int,
    max_total_tokens: int,
    mesh: Any = None,
    overlap: bool = False,
    **extra: Any,
) -> Scheduler:
    """A speculative scheduler (``k = K``) recording logits over a new sliding-window cache
    (``mesh``: the mesh its pools are sharded over, with ``tp_size`` in ``extra``, the other
    ``CacheConfig`` fields; ``overlap``: overlap scheduling), checking the accounting after every step."""
    config = parity_cache_config(
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=8,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        **extra,
    )
    cache = build_kv_cache(target.spec, config, draft_spec=draft.spec, mesh=mesh)
    assert cache.is_hybrid_swa and "kv_draft" in cache.pools
    sched = scheduler_for(
        target,
        cache,
        draft=draft,
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        overlap=overlap,
    )
    assert isinstance(sched.extensions[0], SWAServing)
    _checked_every_step(sched)
    return sched


def serve(
    models: dict[str, Any],
    draft: str,
    *,
    page_size: int,
    max_total_tokens: int,
    seed: int = 3,
    max_new: int = MAX_NEW,
    **extra: Any,
) -> tuple[Scheduler, dict[str, ServingReq], dict[str, int]]:
    """The harness's two rounds with the draft named ``draft`` of ``models``; ``extra``: more
    ``spec_scheduler`` arguments (a mesh and its ``tp_size``)."""
    sched = spec_scheduler(
        models["target"], models[draft], page_size=page_size, max_total_tokens=max_total_tokens, **extra
    )
    evicted = _count_evictions(sched)
    done = serve_two_rounds(sched, max_new, seed=seed)  # leak free after both rounds
    check_accounting(sched)
    return sched, done, evicted


def _draft(sched: Scheduler) -> DraftDecoding:
    assert isinstance(sched.proposer, DraftDecoding)
    return sched.proposer


def test_the_target_as_its_own_draft_accepts_everything_and_warm_gives_the_cold_tokens(family):
    sched, done, _ = serve(family, "target", page_size=4, max_total_tokens=1024, max_new=LONG)
    sp = _draft(sched).stats
    assert sp.acceptance_rate == 1.0, f"the target as its own draft must accept every proposal: {sp}"
    assert sched.stats.cached_tokens > 0
    assert (done["chat2"].first_cached_tokens or 0) >= 16 and (done["d"].first_cached_tokens or 0) >= 16
    swa = sched.extensions[0]
    assert isinstance(swa, SWAServing) and swa.freed_swa_tokens > 0, "decode should free out-of-window SWA slots"
    tree = sched.cache.tree_cache
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes()), "the tree should hold SWA tombstones"
    # fewer target forwards than tokens: a round yields up to k + 1 tokens per request
    assert sched.stats.decode_steps * 2 < sum(len(r.output_ids) for r in done.values())
    assert_matches_transformers(family["hf"], done, max_new=LONG, atol=LOGIT_ATOL)
    # warm: every prompt of round 1 again, now cached, gives its cold tokens
    p = prompts()
    again = [ServingReq(f"{n}-warm", p[n], max_new_tokens=LONG) for n in ("a", "b", "c")]
    sched.run(again)
    assert all((r.first_cached_tokens or 0) >= 16 for r in again)
    assert [r.output_ids for r in again] == [done[n].output_ids for n in ("a", "b", "c")]
    assert sched.leak_free()


def test_a_partly_agreeing_draft_with_pools_small_enough_to_evict_and_retract(family):
    sched, done, evicted = serve(family, "first-layer", page_size=1, max_total_tokens=64)
    sp = _draft(sched).stats
    assert 0 < sp.accepted_tokens < sp.proposed_tokens, f"rounds should mix accepted and rejected drafts: {sp}"
    assert sp.rolled_back_slots > 0
    assert evicted["full"] > 0 and evicted["swa"] > 0, f"both pools should be evicted from, got {evicted}"
    assert sched.stats.retractions > 0, "the pools should be small enough to force retraction"
    assert sched.stats.cached_tokens > 0
    assert_matches_transformers(family["hf"], done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_overlap_chains_rounds_over_the_sliding_window_pools(family):
    """Overlap scheduling: round ``N + 1`` launched before round ``N`` is read, its SWA slots moved on
    the device with the full ones (``overlap.shift_metadata``), through eviction on both sides and
    retraction, with a partly agreeing draft: Transformers' tokens and logits, both sides' accounting
    after every step (a request holding up to the round in flight's reserve)."""
    sched, done, evicted = serve(family, "first-layer", page_size=1, max_total_tokens=64, overlap=True)
    sp = _draft(sched).stats
    assert sp.overlapped_rounds > 0, f"rounds should be chained on the device: {sp}"
    assert 0 < sp.accepted_tokens < sp.proposed_tokens and sp.rolled_back_slots > 0, f"{sp}"
    assert evicted["full"] > 0 and evicted["swa"] > 0, f"both pools should be evicted from, got {evicted}"
    assert sched.stats.retractions > 0 and sched.stats.cached_tokens > 0
    assert_matches_transformers(family["hf"], done, max_new=MAX_NEW, atol=LOGIT_ATOL)


@pytest.mark.slow  # ~25 s: the partly agreeing draft above rejects too, in the default suite
@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)  # Gemma 3's tied head: tiny models agree a lot
def test_an_unrelated_draft_still_gives_the_exact_tokens(family):
    sched, done, _ = serve(family, "unrelated", page_size=4, max_total_tokens=1024)
    sp = _draft(sched).stats
    assert sp.acceptance_rate < 0.5 and sp.rolled_back_slots > 0, f"{sp}"
    assert_matches_transformers(family["hf"], done, max_new=MAX_NEW, atol=LOGIT_ATOL)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_pure_sliding_window_target_with_a_small_pool(mistral, overlap):
    """A window on every layer (the request table holds SWA slots, zeroed as windows pass), with
    overlap scheduling (rounds chained on the device) and without."""
    sched, done, _ = serve(
        mistral, "first-layer", page_size=1, max_total_tokens=48, seed=MISTRAL_PROMPT_SEED, overlap=overlap
    )
    assert not sched.cache.full_tokens_per_layer and isinstance(sched.tree, PureSWARadixCache)
    sp = _draft(sched).stats
    assert sp.accepted_tokens > 0 and sp.rolled_back_slots > 0
    assert (sp.overlapped_rounds > 0) == overlap, f"{sp}"
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert_matches_transformers(mistral["hf"], done, max_new=MAX_NEW, atol=LOGIT_ATOL)


# --- the plan -----------------------------------------------------------------------------------


def _standalone(**fields: Any) -> CacheConfig:
    return CacheConfig(
        page_size=4,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
        **fields,
    )


def test_the_draft_pool_is_indexed_by_the_full_slots_and_inside_the_budget():
    spec = ModelSpec.preset("gemma3-tiny")
    budget = 2**20
    plan = plan_kv_cache(spec, _standalone(memory_budget_bytes=budget, platform="cpu"), draft_spec=spec)
    pools = {p.name: p for p in plan.pools}
    assert pools["kv_draft"].shape[0] == pools["kv_full"].shape[0], "one draft page per full page"
    assert plan.device_bytes <= budget
    # without a budget the split is the plain one
    plain = plan_kv_cache(spec, CacheConfig(page_size=4, max_total_tokens=256))
    drafted = plan_kv_cache(spec, _standalone(max_total_tokens=256), draft_spec=spec)
    assert (drafted.full_tokens_per_layer, drafted.swa_tokens_per_layer) == (
        plain.full_tokens_per_layer,
        plain.swa_tokens_per_layer,
    )


def test_a_pure_sliding_window_target_refuses_a_draft_that_sees_past_its_window(mistral):
    target: ModelSpec = mistral["target"].spec
    wide = ModelSpec.preset("gemma3-tiny")  # a full-attention layer
    with pytest.raises(ConfigError, match="draft_spec.*every layer slides"):
        plan_kv_cache(target, _standalone(max_total_tokens=256), draft_spec=wide)
    wider = dataclasses.replace(mistral["first-layer"].spec, sliding_window=int(target.sliding_window or 0) * 2)
    with pytest.raises(ConfigError, match="a sliding window of 16"):
        plan_kv_cache(target, _standalone(max_total_tokens=256), draft_spec=wider)


# --- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["gemma3-tiny", pytest.param("mistral-swa-tiny", marks=pytest.mark.slow)])
def test_generate_decodes_a_sliding_window_preset_speculatively_with_the_plain_tokens(preset, capsys):
    """``generate`` with a STANDALONE draft (the preset itself) over prompts longer than the window
    gives the tokens of ``generate`` without one (hybrid pools for Gemma 3, one SWA pool for the
    Mistral with a window on every layer)."""
    import json

    from kvjax.cli import main

    window = ModelSpec.preset(preset).sliding_window or 0
    long = ",".join(str(t) for t in range(1, 2 * window + 7))
    argv = ["generate", "--model", preset, "--prompt-ids", long, "--prompt-ids", "5,6,7,8,9"]
    argv += ["--max-new-tokens", "10", "--page-size", "4", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    spec = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", preset]
    assert main([*argv, *spec]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["outputs"] == plain["outputs"]
    assert report["speculative"]["acceptance_rate"] == 1.0  # the target as its own draft
