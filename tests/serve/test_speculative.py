"""Speculative decoding (STANDALONE) through the serving loop, on the tiny preset.

The target is the ``tiny`` preset (two layers, random weights); the drafts are the target itself
(it must accept every proposal), its first layer alone (same embedding, head and first layer: it
agrees part of the time, so rounds mix accepted and rejected tokens) and an unrelated one-layer
model (it agrees almost never). Every run must give exactly the plain loop's greedy tokens, keep
the token accounting after every step (``random_workloads.check_step``: the draft shares the
target's slots, so nothing of its own is counted) and end leak free, at page sizes 1 (a pool small
enough to evict and retract) and 16 (partial pages stay with their requests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.errors import ConfigError
from kvjax.serve.model import init_params
from kvjax.serve.model_config import ModelConfig, model_config_from_spec
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative import DraftDecoding, speculative_scheduler
from kvjax.serve.speculative.acceptance import accepted_lengths, limit_accepted
from kvjax.serve.speculative.rollback import rejected_slots
from tests.serve.random_workloads import CONTEXT, check_end, draw_workload, drive

SPEC = ModelSpec.preset("tiny")
K = 3  # draft tokens per round
PLAIN = CacheConfig(page_size=1, context_length=CONTEXT, max_total_tokens=512)  # the plain loop's cache


def one_layer(spec: ModelSpec, name: str) -> ModelSpec:
    return dataclasses.replace(spec, name=name, num_hidden_layers=1, layer_kinds=spec.layer_kinds[:1])


@functools.cache
def models() -> dict[str, tuple[ModelSpec, ModelConfig, Any]]:
    """The target and the drafts of the module docstring: ``(spec, config, params)`` by name."""
    config = model_config_from_spec(SPEC)
    params = init_params(config)
    small = one_layer(SPEC, "tiny-1-layer")
    small_config = model_config_from_spec(small)
    first_layer = {"model": {k: v for k, v in params["model"].items() if k != "layers_1"}, "lm_head": params["lm_head"]}
    return {
        "target": (SPEC, config, params),
        "first-layer": (small, small_config, first_layer),
        "unrelated": (small, small_config, init_params(small_config, seed=7)),
    }


def spec_cache(draft: ModelSpec, *, page_size: int, pool: int, **config: Any) -> Any:
    settings = dict(
        page_size=page_size,
        max_total_tokens=pool,
        context_length=CONTEXT,
        chunked_prefill_size=16,
        max_running_requests=8,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=K,
        speculative_num_draft_tokens=K + 1,
    )
    return build_kv_cache(SPEC, CacheConfig(**{**settings, **config}), draft_spec=draft)


def spec_scheduler(draft: str, *, page_size: int, pool: int, **config: Any) -> Scheduler:
    _, config_t, params = models()["target"]
    dspec, dconfig, dparams = models()[draft]
    cache = spec_cache(dspec, page_size=page_size, pool=pool, **config)
    return speculative_scheduler(
        config_t,
        cache,
        params,
        draft=dconfig,
        draft_params=dparams,
        num_steps=K,
        max_batch_size=4,
        chunked_prefill_size=16,
    )


# --- acceptance and rollback (pure) ---------------------------------------------------------------


def test_acceptance_is_the_longest_agreeing_prefix():
    draft = np.array([[5, 6, 7], [5, 6, 7], [1, 6, 7], [5, 9, 7]])
    target = np.array([[5, 6, 7, 8], [5, 6, 0, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    assert accepted_lengths(draft, target).tolist() == [3, 2, 0, 1]
    with pytest.raises(ValueError, match="expected"):
        accepted_lengths(draft, target[:, :3])


def test_kept_tokens_stop_at_the_room_left_and_after_a_stop_token():
    tokens = np.array([4, 2, 9, 3])
    assert limit_accepted(tokens, 10, ()) == [4, 2, 9, 3]
    assert limit_accepted(tokens, 2, ()) == [4, 2]
    assert limit_accepted(tokens, 10, {2}) == [4, 2]
    assert limit_accepted(tokens, 0, ()) == []


def test_rollback_frees_every_rejected_slot_at_page_1_and_whole_pages_only_at_page_16():
    row = np.arange(100, 200)
    # page 1: positions 10..13 were the round's; 2 kept -> positions 12, 13 go back
    assert rejected_slots(row, 10, 12, 14, 1).tolist() == [112, 113]
    assert rejected_slots(row, 10, 14, 14, 1).tolist() == []
    # page 16: round over positions 14..17 (pages 0 and 1); 15 kept -> page 1 (16, 17) goes back
    assert rejected_slots(row, 14, 15, 18, 16).tolist() == [116, 117]
    # 17 kept: the partial page 1 stays with the request, nothing goes back
    assert rejected_slots(row, 14, 17, 18, 16).tolist() == []
    with pytest.raises(ValueError, match="outside"):
        rejected_slots(row, 10, 9, 14, 1)


# --- the loop ---------------------------------------------------------------------------------


def _plain_outputs(turns: Any, *, page_size: int, pool: int) -> dict[str, list[int]]:
    _, config, params = models()["target"]
    cache = build_kv_cache(
        SPEC,
        CacheConfig(page_size=page_size, max_total_tokens=pool, context_length=CONTEXT, chunked_prefill_size=16),
    )
    plain = Scheduler(config, cache, params, max_batch_size=4, chunked_prefill_size=16, overlap=False)
    return drive(plain, turns, check=False)


@pytest.mark.parametrize(
    ("page_size", "pool", "seed"),
    [(1, 72, 3), (16, 512, 5), (16, 128, 5)],
    ids=["page1-evict-retract", "page16", "page16-evict-retract"],
)
def test_rounds_give_the_plain_loops_tokens_with_accounting_after_every_step(page_size, pool, seed):
    turns = draw_workload(seed, requests=8, max_kv=min(pool, CONTEXT) - page_size - K - 1)
    expected = _plain_outputs(turns, page_size=page_size, pool=pool)
    sched = spec_scheduler("first-layer", page_size=page_size, pool=pool)
    got = drive(sched, turns)  # check_step after every step
    check_end(sched)
    sched.cache.tree_cache.sanity_check()
    assert got == expected
    sp = _draft(sched).stats
    assert 0 < sp.accepted_tokens < sp.proposed_tokens, "rounds should mix accepted and rejected drafts"
    assert sp.rolled_back_slots > 0
    assert sched.stats.cached_tokens > 0
    if pool < 256:
        assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0


def test_a_draft_equal_to_the_target_accepts_everything_and_an_unrelated_one_still_gives_exact_tokens():
    rng = np.random.default_rng(11)
    system = [int(t) for t in rng.integers(0, 256, 20)]
    prompts = [system + [int(t) for t in rng.integers(0, 256, n)] for n in (3, 7, 5)]

    def serve(sched: Scheduler) -> list[list[int]]:
        reqs = [ServingReq(i, p, max_new_tokens=9) for i, p in enumerate(prompts)]
        sched.run(reqs)
        assert sched.leak_free()
        return [r.output_ids for r in reqs]

    _, config, params = models()["target"]
    plain = Scheduler(
        config, build_kv_cache(SPEC, CacheConfig(page_size=1, context_length=CONTEXT, max_total_tokens=512)), params
    )
    expected = serve(plain)
    same = spec_scheduler("target", page_size=1, pool=512)
    assert serve(same) == expected
    assert _draft(same).stats.acceptance_rate == 1.0
    # every round but a request's last yields k + 1 tokens
    assert same.stats.decode_steps < plain.stats.decode_steps
    unrelated = spec_scheduler("unrelated", page_size=1, pool=512)
    assert serve(unrelated) == expected
    assert _draft(unrelated).stats.acceptance_rate < 0.2


def test_stop_tokens_end_a_request_inside_a_round():
    _, config, params = models()["target"]
    prompt = list(range(10, 40))
    plain = Scheduler(
        config, build_kv_cache(SPEC, CacheConfig(page_size=1, context_length=CONTEXT, max_total_tokens=512)), params
    )
    [free_run] = plain.run([ServingReq("a", prompt, max_new_tokens=12)])
    stop = free_run.output_ids[4]
    first_stop = free_run.output_ids.index(stop)
    sched = spec_scheduler("target", page_size=16, pool=256)
    [req] = sched.run([ServingReq("a", prompt, max_new_tokens=12, stop_token_ids=[stop])])
    assert req.output_ids == free_run.output_ids[: first_stop + 1]
    assert sched.leak_free()


def test_refusals_name_the_value():
    _, config, params = models()["target"]
    dspec, dconfig, dparams = models()["first-layer"]
    cache = spec_cache(dspec, page_size=1, pool=256)
    overlapped = speculative_scheduler(
        config, cache, params, draft=dconfig, draft_params=dparams, num_steps=K, overlap=True
    )
    assert overlapped.overlap and _draft(overlapped).chains  # rounds overlap (test_speculative_overlap)
    with pytest.raises(ConfigError, match="speculative_num_steps"):
        speculative_scheduler(config, cache, params, draft=dconfig, draft_params=dparams, num_steps=0)
    with pytest.raises(ConfigError, match="layers"):
        speculative_scheduler(config, cache, params, draft=config, draft_params=params, num_steps=K)
    other_vocab = dconfig.replace(vocab_size=512)
    with pytest.raises(ConfigError, match="vocab_size"):
        speculative_scheduler(config, cache, params, draft=other_vocab, draft_params=dparams, num_steps=K)
    plain_cache = build_kv_cache(SPEC, PLAIN)
    with pytest.raises(ConfigError, match="no draft pool"):
        speculative_scheduler(config, plain_cache, params, draft=dconfig, draft_params=dparams, num_steps=K)
    small = spec_cache(dspec, page_size=1, pool=106)
    sched = speculative_scheduler(config, small, params, draft=dconfig, draft_params=dparams, num_steps=K)
    sched.submit([ServingReq("fits", list(range(1, 100)), max_new_tokens=5)])  # a last round of 106 tokens
    with pytest.raises(ConfigError, match="max_total_tokens"):  # the plain loop would fit it, not its last round
        sched.submit([ServingReq("long", list(range(1, 101)), max_new_tokens=5)])
    assert [r.rid for r in sched.waiting] == ["fits"]


def _draft(sched: Scheduler) -> DraftDecoding:
    """The scheduler's draft-model proposer."""
    assert isinstance(sched.proposer, DraftDecoding)
    return sched.proposer
