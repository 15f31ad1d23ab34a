"""Sessions (issue 37): a conversation's KV is held between its turns, released at close, and never
deadlocks the server.

A tiny random-weight Llama checkpoint made with Transformers is served through sessions; every
turn's greedy tokens and logits are compared with Transformers' ``generate`` on the whole
conversation so far (every earlier turn's prompt and output, then the new tokens):

* 4 sessions of 20 turns each, interleaved, next to a flood of one-off prompts that fills the pool
  (memory pressure on the tree): while a session lives, each turn prefills only its new tokens and
  the previous turn's last output token (whose KV no step wrote), nothing else;
* the same sessions in a pool too small to hold them all: holds are released (least recently used
  first) instead of retracting running requests, nothing deadlocks, and turns stay exact;
* a turn retracted mid-decode: the session goes on;
* after close: no slot or row left behind (``leak_free``), the session's KV unlocked in the tree.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_matches_transformers,
    tiny_checkpoint,
    transformers,
)
from tests.serve.random_workloads import TINY_LAYER_SIZES

LOGIT_ATOL = 1e-4
SESSIONS = 4
TURNS = 20
NEW = 3  # new tokens per turn
OUT = 2  # generated tokens per turn
VOCAB = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    config = transformers.LlamaConfig(**dict(TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=2))
    return tiny_checkpoint(config, tmp_path_factory, "session-llama", seed=1)


def _scheduler(
    model: LoadedModel, *, page_size: int, max_total_tokens: int, overlap: bool = True, **config_fields: Any
) -> Scheduler:
    config = CacheConfig(
        context_length=256,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        chunked_prefill_size=32,
        **config_fields,
    )
    return Scheduler(
        model.config,
        build_kv_cache(model.spec, config),
        model.params,
        max_batch_size=4,
        chunked_prefill_size=32,
        record_logits=True,
        overlap=overlap,
    )


def _turns(seed: int = 5) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, VOCAB, NEW).tolist() for _ in range(TURNS)] for _ in range(SESSIONS)]


def _serve_sessions(
    sched: Scheduler, flood: int = 0, *, seed: int = 5, max_prefilled: bool = True
) -> dict[str, ServingReq]:
    """Serve ``SESSIONS`` sessions turn by turn, interleaved (each round submits one turn of every
    session, with ``flood`` one-off prompts of 24 tokens), check each turn's prefill while its session
    holds, and close them. Returns every turn by name."""
    rng = np.random.default_rng(seed + 100)
    sids = [sched.open_session(f"chat{s}") for s in range(SESSIONS)]
    done: dict[str, ServingReq] = {}
    for turn in range(TURNS):
        reqs = [
            ServingReq(f"chat{s}/turn{turn}", _turns(seed)[s][turn], max_new_tokens=OUT, session_id=sid)
            for s, sid in enumerate(sids)
        ]
        floods = [
            ServingReq(f"flood{turn}/{i}", rng.integers(0, VOCAB, 24).tolist(), max_new_tokens=1) for i in range(flood)
        ]
        released_before = sched.sessions.released
        sched.run([*floods, *reqs])
        for req in reqs:
            done[req.rid] = req
            computed = len(req.origin_input_ids) - req.first_cached_tokens
            if max_prefilled and turn > 0 and sched.sessions.released == released_before and not req.retracted:
                assert computed == NEW + 1, f"{req.rid}: prefilled {computed} tokens, not the new turn's {NEW} + 1"
    for sid in sids:
        sched.close_session(sid)
    return done


def _assert_exact(hf: Any, done: dict[str, ServingReq]) -> None:
    assert_matches_transformers(hf, done, max_new=OUT, atol=LOGIT_ATOL)


@pytest.mark.parametrize("page_size", [1, 16])
def test_sessions_hold_their_kv_under_tree_pressure_and_prefill_only_each_new_turn(model, page_size):
    hf, loaded = model
    # Room for the four conversations (about 100 tokens each, page-rounded) and not much more:
    # the flood's prompts are evicted from the tree, the sessions' held KV never is.
    sched = _scheduler(loaded, page_size=page_size, max_total_tokens=4 * 128 + 96)
    done = _serve_sessions(sched, flood=3)
    assert sched.stats.evicted_tokens > 0, "the flood must press on the pool"
    assert sched.sessions.released == 0 and sched.stats.retractions == 0
    assert sched.leak_free() and len(sched.sessions) == 0
    _assert_exact(hf, done)
    # Each conversation is in the tree after close, unlocked: its next user hits it.
    assert sched.tree.protected_size() == 0


@pytest.mark.parametrize("host_tier", [False, True])
def test_sessions_that_do_not_fit_release_their_holds_instead_of_deadlocking(model, host_tier):
    hf, loaded = model
    # Room for about two conversations: holds are released, least recently used first; with the
    # host tier, a released conversation's KV is backed up there and loaded back for its next turn.
    sched = _scheduler(loaded, page_size=4, max_total_tokens=240, enable_hierarchical_cache=host_tier)
    assert sched.sessions.holds
    done = _serve_sessions(sched, flood=0)
    # Four running turns of up to ~100 tokens do not fit either: some are retracted too, and
    # the sessions go on.
    assert sched.sessions.released > 0
    if host_tier:
        [ext] = sched.extensions
        assert ext.loaded_tokens > 0
        sched.cache.tree_cache.check_transfers(wait=True)
        assert ext.host_balanced()
    assert sched.leak_free()
    _assert_exact(hf, done)


def test_a_retracted_session_turn_resumes_and_the_session_goes_on(model):
    hf, loaded = model
    # Two 50-token first turns fill the pool; their decode steps cannot both go on: one is retracted.
    sched = _scheduler(loaded, page_size=1, max_total_tokens=112, overlap=False)
    rng = np.random.default_rng(9)
    sids = [sched.open_session() for _ in range(2)]
    done: dict[str, ServingReq] = {}
    for turn, (new, out) in enumerate([(50, 8), (4, 4)]):
        reqs = [
            ServingReq(f"{sid}/{turn}", rng.integers(0, VOCAB, new).tolist(), max_new_tokens=out, session_id=sid)
            for sid in sids
        ]
        sched.run(reqs)
        done.update({r.rid: r for r in reqs})
        if turn == 0:
            assert sched.stats.retractions > 0 and any(r.retracted for r in reqs)
    for sid in sids:
        sched.close_session(sid)
    assert sched.leak_free()
    for turn, out in enumerate([8, 4]):
        assert_matches_transformers(
            hf, {k: v for k, v in done.items() if k.endswith(f"/{turn}")}, max_new=out, atol=LOGIT_ATOL
        )


def test_session_misuse_is_refused_and_changes_nothing(model):
    _, loaded = model
    sched = _scheduler(loaded, page_size=4, max_total_tokens=256)
    sid = sched.open_session("s", extra_key="tenant-a")
    assert sid == "s"
    with pytest.raises(ValueError, match="already open"):
        sched.open_session("s")
    with pytest.raises(KeyError, match="no open session 'nope'"):
        sched.submit([ServingReq("r", [1, 2, 3], max_new_tokens=2, session_id="nope")])
    with pytest.raises(ValueError, match="one turn at a time"):
        sched.submit(
            [
                ServingReq("a", [1, 2, 3], max_new_tokens=2, session_id="s"),
                ServingReq("b", [4, 5, 6], max_new_tokens=2, session_id="s"),
            ]
        )
    with pytest.raises(ValueError, match="extra_key 'tenant-b' differs"):
        sched.submit([ServingReq("c", [1, 2, 3], max_new_tokens=2, session_id="s", extra_key="tenant-b")])
    assert not sched.waiting and sched.stats.prompt_tokens == 0
    first = ServingReq("t0", [1, 2, 3], max_new_tokens=2, session_id="s")
    sched.submit([first])
    with pytest.raises(ValueError, match="turn in flight"):
        sched.close_session("s")
    with pytest.raises(ValueError, match="turn in flight"):
        sched.submit([ServingReq("t1", [4], max_new_tokens=2, session_id="s")])
    sched.run()
    assert first.extra_key == "tenant-a" and first.req_pool_idx is not None  # held for the next turn
    second = ServingReq("t1", [4, 5], max_new_tokens=2, session_id="s")
    sched.run([second])
    assert list(second.origin_input_ids) == [1, 2, 3, *first.output_ids, 4, 5]
    assert second.first_cached_tokens == 4  # the first turn's KV: all but its last output token
    sched.close_session("s")
    assert sched.leak_free()


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_dp2_sessions_stick_to_their_rank(model, policy):
    from kvjax.dp.scheduler import DPScheduler

    hf, loaded = model
    config = CacheConfig(
        context_length=256,
        page_size=4,
        max_total_tokens=1024,
        chunked_prefill_size=32,
        dp_size=2,
        tp_size=2,
        enable_dp_attention=True,
    )
    ranks = [
        Scheduler(
            loaded.config, build_kv_cache(loaded.spec, config), loaded.params, max_batch_size=4, record_logits=True
        )
        for _ in range(2)
    ]
    front = DPScheduler(ranks, policy=policy)
    sids = [front.open_session() for _ in range(SESSIONS)]
    done: dict[str, ServingReq] = {}
    turns = _turns()
    for turn in range(4):
        reqs = [
            ServingReq(f"{sid}/{turn}", turns[s][turn], max_new_tokens=OUT, session_id=sid)
            for s, sid in enumerate(sids)
        ]
        front.run(reqs)
        for s, req in enumerate(reqs):
            done[req.rid] = req
            assert front.rank_of[req.rid] == front.session_rank(sids[s])
            if turn:
                assert len(req.origin_input_ids) - req.first_cached_tokens == NEW + 1
    assert {front.session_rank(sid) for sid in sids} == {0, 1}
    for sid in sids:
        front.close_session(sid)
    assert front.leak_free()
    _assert_exact(hf, done)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_session_reuses_its_kv_with_the_radix_cache_off(page_size):
    """With ``disable_radix_cache`` (a ``ChunkCache``) nothing is shared between requests, but a
    session's hold still carries its KV to the next turn (SGLang's streaming session), with the
    tokens of the radix tree."""
    from kvjax import ModelSpec
    from kvjax.demo import demo_cache
    from kvjax.serve.model import init_params

    spec = ModelSpec.preset("tiny")
    params = init_params(spec)
    outputs = {}
    for disable in (True, False):
        sched = Scheduler(spec, demo_cache(page_size=page_size, disable_radix_cache=disable), params)
        sid = sched.open_session()
        turns = [ServingReq(f"t{t}", [5 + t, 6, 7], max_new_tokens=3, session_id=sid) for t in range(4)]
        for req in turns:
            sched.run([req])
        assert [len(r.origin_input_ids) - r.first_cached_tokens for r in turns] == [3, 4, 4, 4]
        sched.close_session(sid)
        assert sched.leak_free()
        outputs[disable] = [r.output_ids for r in turns]
    assert outputs[True] == outputs[False]
