"""``OwnLoop``: a user's own loop through admission, chunked prefill, decode, finish and abort,
with prefix reuse and eviction; no slot ever has two owners and nothing leaks.

The token test runs a real jitted step of a small model of one's own (``attend`` over the pools)
and checks that a warm run (prefix reused, prompts in chunks) gives the tokens of a cold one. The
property test drives the bookkeeping with random calls; the step is not run (its pools are handed
back unchanged: the bookkeeping does not read them)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax.attention import attend
from kvjax.errors import InvalidSlotError, OutOfMemoryError

SPEC = kvjax.ModelSpec.preset("tiny")  # 2 layers, 4 query heads and 2 KV heads of 16, vocab 256
H, KVH, D, E = 4, 2, 16, 32


def _params() -> dict:
    k0, k1, k2, k3 = jax.random.split(jax.random.key(1), 4)
    return {
        "embed": jax.random.normal(k0, (SPEC.vocab_size, E)),
        "wq": jax.random.normal(k1, (2, E, H * D)) * 0.3,
        "wkv": jax.random.normal(k2, (2, E, 2 * KVH * D)) * 0.3,
        "wo": jax.random.normal(k3, (2, H * D, E)) * 0.3,
    }


@functools.partial(jax.jit, donate_argnums=0)
def _step(pools, params, tokens, meta):
    x = params["embed"][tokens]
    for layer in range(2):
        q = (x @ params["wq"][layer]).reshape(-1, H, D)
        k, v = jnp.split((x @ params["wkv"][layer]).reshape(-1, 2 * KVH, D), 2, axis=1)
        out, pools = attend(pools, layer, q, k, v, meta)
        x = x + out.reshape(-1, H * D) @ params["wo"][layer]
    return pools, x[meta.logits_indices] @ params["embed"].T


def _cache(page_size: int = 4, tokens: int = 256) -> kvjax.KVCache:
    config = kvjax.CacheConfig(page_size=page_size, max_total_tokens=tokens, max_running_requests=4, context_length=64)
    return kvjax.build_kv_cache(SPEC, config)


def _generate(
    loop: kvjax.OwnLoop, params: dict, prompts: list[list[int]], new: int, chunk: int | None
) -> list[list[int]]:
    """Greedy decoding of ``prompts`` together, ``new`` tokens each, prompts in chunks of ``chunk``."""
    reqs = [loop.admit(p) for p in prompts]
    outputs: dict[int, list[int]] = {id(r): [] for r in reqs}
    while loop.requests:
        batch = loop.prepare(loop.requests, max_tokens=chunk)
        pools, logits = _step(loop.cache.pools, params, batch.tokens, batch.meta)
        loop.commit(batch, pools)
        for req, row in zip(batch.requests, np.asarray(logits), strict=False):
            if req.pending:
                continue  # a prompt chunk: no token yet
            out = outputs[id(req)]
            out.append(int(np.argmax(row)))
            if len(out) == new:
                loop.finish(req)
            else:
                loop.append(req, out[-1])
        assert loop.leak_free()
    return [outputs[id(r)] for r in reqs]


def test_warm_chunked_run_equals_a_cold_one():
    params = _params()
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 256, 20).tolist()
    prompts = [shared + rng.integers(1, 256, n).tolist() for n in (5, 9, 3)]
    warm = kvjax.OwnLoop(_cache(), max_seqs=4)
    _generate(warm, params, [shared + [7]], 2, None)  # caches the shared part
    got = _generate(warm, params, prompts, 5, chunk=6)
    reused = [r for r in warm.tree.match_prefix(prompts[0]).indices]
    assert len(reused) >= 20
    for prompt, out in zip(prompts, got, strict=True):
        cold = kvjax.OwnLoop(_cache(), max_seqs=4)
        assert _generate(cold, params, [prompt], 5, None) == [out]
    assert warm.cache.pools is not None  # the pools handed back are current (not donated)


def test_refusals_change_nothing():
    loop = kvjax.OwnLoop(_cache(tokens=32), max_seqs=2)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        loop.admit([])
    with pytest.raises(ValueError, match="integer token ids"):
        loop.admit([1.5, 2.0])
    a = loop.admit(list(range(1, 30)))
    batch = loop.prepare([a], max_tokens=8)
    with pytest.raises(ValueError, match="not committed yet"):
        loop.prepare([a])
    with pytest.raises(ValueError, match="not committed yet"):
        loop.finish(a)
    loop.discard(batch)
    assert loop.leak_free() and a.computed == 0
    b = loop.admit(list(range(40, 60)))
    loop.commit(loop.prepare([a]), loop.cache.pools)
    with pytest.raises(OutOfMemoryError, match="do not fit"):
        loop.prepare([b])  # 29 + 20 tokens in a pool of 32: nothing to evict (a is running)
    assert loop.leak_free()
    with pytest.raises(ValueError, match="nothing to compute"):
        loop.prepare([a])
    loop.abort(b)
    with pytest.raises(ValueError, match="aborted"):
        loop.append(b, 3)
    loop.finish(a)
    assert loop.leak_free() and not loop.requests


def test_caches_that_need_the_scheduler_are_refused():
    gemma = kvjax.ModelSpec.preset("gemma3-tiny")
    cache = kvjax.build_kv_cache(
        gemma, kvjax.CacheConfig(max_total_tokens=256, max_running_requests=4, context_length=64)
    )
    with pytest.raises(NotImplementedError, match="SWAServing"):
        kvjax.OwnLoop(cache, max_seqs=2)


# "step" is a prepare and its commit; listed twice, as in a loop most calls are steps.
_ACTIONS = st.sampled_from(
    ["admit", "step", "step", "prepare", "commit", "discard", "append", "finish", "abort", "evict"]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 4]), data=st.data())
def test_random_calls_never_alias_or_leak(page_size, data):
    cache = _cache(page_size=page_size, tokens=96)
    loop = kvjax.OwnLoop(cache, max_seqs=3)
    alloc, tree = loop.allocator, loop.tree
    batches: list[kvjax.LoopBatch] = []
    stems = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], [1, 2, 3, 4, 10, 11]]
    for _ in range(data.draw(st.integers(10, 40), label="calls")):
        action = data.draw(_ACTIONS, label="action")
        idle = [r for r in loop.requests if r._batch is None]
        try:
            if action == "admit":
                stem = data.draw(st.sampled_from(stems), label="stem")
                tail = data.draw(st.lists(st.integers(1, 20), max_size=12), label="tail")
                loop.admit(stem + tail)
            elif action in ("prepare", "step") and idle:
                chosen = data.draw(st.lists(st.sampled_from(idle), min_size=1, max_size=3, unique_by=id), label="reqs")
                chunk = data.draw(st.one_of(st.none(), st.integers(1, 9)), label="chunk")
                batch = loop.prepare([r for r in chosen if r.pending] or chosen, max_tokens=chunk)
                if action == "prepare":
                    batches.append(batch)
                else:
                    loop.commit(batch, cache.pools)
            elif action in ("commit", "discard") and batches:
                batch = batches.pop(data.draw(st.integers(0, len(batches) - 1), label="batch"))
                loop.commit(batch, cache.pools) if action == "commit" else loop.discard(batch)
            elif action == "append" and idle:
                req = data.draw(st.sampled_from(idle), label="req")
                loop.append(req, data.draw(st.integers(1, 20), label="token"))
            elif action in ("finish", "abort") and idle:
                req = data.draw(st.sampled_from(idle), label="req")
                loop.finish(req) if action == "finish" else loop.abort(req)
            elif action == "evict":
                tree.evict(data.draw(st.integers(1, 64), label="evict"))
        except (OutOfMemoryError, ValueError) as refused:  # a full pool or table, a too-long row
            assert "do not fit" in str(refused) or "row" in str(refused) or "nothing to compute" in str(refused)
        loop.owners()  # raises InvalidSlotError on a slot with two owners
        assert loop.leak_free()
        alloc.check_invariants()
        tree.check_invariants()
    for batch in batches:
        loop.discard(batch)
    for req in list(loop.requests):
        loop.finish(req)
    tree.evict(10**6)
    assert alloc.available_size() == alloc.size, "every slot came back"
    with pytest.raises(InvalidSlotError):
        alloc.free(np.array([alloc.size + page_size + 1]))
