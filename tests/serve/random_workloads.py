"""Seeded random workloads through the serving loop, with every invariant checked after every step.

A workload (``draw_workload``) is a pure function of its seed and limits: requests with random
prompts, many sharing one of a few random prefixes (system prompts), some exact repeats, arriving
at random steps, and multi-turn follow-ups (a turn is submitted when the previous one finishes:
its prompt + its output + new tokens). ``drive`` runs it through a ``Scheduler`` and, after every
step, checks (``check_step``):

* the allocator's, the request table's and the tree's own invariants (``check_invariants``,
  ``sanity_check``), and the host allocator's with a host tier;
* the token accounting: ``available + evictable + protected + held by live requests == capacity``
  for a full-attention allocator, each live request holding its pages beyond its tree prefix;
* with recurrent state: ``free + the tree's checkpoints + held by requests == state slots``;
* the host pool's balance (``HostTierExtension.host_balanced``).

At the end the run must be leak-free (``Scheduler.leak_free``, and no state slot held), and
``run_case`` serves the same workload with the radix cache off (cold): every request must get
the same tokens (cold == warm). Failures name the case and its seed.

Models: the tiny presets (``tiny``, ``deepseek-tiny``, ``gemma3-tiny``, ``mistral-swa-tiny``) and
tiny Qwen3-Next and Nemotron-H configs (random weights, built without Transformers).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.alloc.swa import SWATokenToKVPoolAllocator
from kvjax.hybrid_req_pool import HybridReqToTokenPool
from kvjax.radix import MambaRadixCache
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.model import init_params
from kvjax.serve.model_config import ModelConfig, model_config_from_spec
from kvjax.serve.model_fingerprint import random_weights_fingerprint
from kvjax.serve.scheduler import Scheduler, ServingReq

CONTEXT = 128
VOCAB = 128  # token ids drawn below this (every model's vocabulary is at least this large)
MAX_STEPS = 2000

# The sizes every tiny model of these tests shares, here and in the Transformers parity tests
# (``parity_harness.TINY_CONFIG``); the vocabulary is each module's own.
TINY_SIZES: dict[str, Any] = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
# The attention and MLP sizes of the tiny models here and of most parity models (all but
# DeepSeek-V2's and gpt-oss's).
TINY_LAYER_SIZES: dict[str, Any] = dict(num_key_value_heads=2, head_dim=16, intermediate_size=128)
_TINY_RECURRENT_BASE: dict[str, Any] = dict(
    TINY_SIZES,
    **TINY_LAYER_SIZES,
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
# Qwen3-Next's layers: three gated-delta-net layers and one full-attention layer (the parity test
# serves the same layout).
QWEN3_NEXT_LAYERS: dict[str, Any] = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
# Qwen3-Next with dense MLPs on every layer (no sparse-MoE layer).
QWEN3_NEXT_DENSE_MLPS: dict[str, Any] = dict(mlp_only_layers=[0, 1, 2, 3], num_experts=0)
QWEN3_NEXT_TINY: dict[str, Any] = dict(
    _TINY_RECURRENT_BASE,
    **QWEN3_NEXT_LAYERS,
    **QWEN3_NEXT_DENSE_MLPS,
    model_type="qwen3_next",
    hidden_act="silu",
    rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
)
# Nemotron-H's blocks: Mamba2 mixers (two groups), MLPs and one attention block ("M-*M-"; the
# parity test serves the same blocks).
NEMOTRON_H_BLOCKS: dict[str, Any] = dict(
    hybrid_override_pattern="M-*M-",
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
)
NEMOTRON_H_TINY: dict[str, Any] = dict(
    _TINY_RECURRENT_BASE,
    **NEMOTRON_H_BLOCKS,
    model_type="nemotron_h",
    num_hidden_layers=5,
    mlp_hidden_act="relu2",
    mamba_hidden_act="silu",
    layer_norm_epsilon=1e-5,
)
RECURRENT_MODELS = {"qwen3-next-tiny": QWEN3_NEXT_TINY, "nemotron-h-tiny": NEMOTRON_H_TINY}


@functools.cache
def model(name: str) -> tuple[ModelSpec, ModelConfig, Any]:
    """``(spec, serving config, weights)`` of a preset or a tiny recurrent model (seed 0), cached."""
    if name in RECURRENT_MODELS:
        spec = ModelSpec.from_hf_config(RECURRENT_MODELS[name], name=name)
    else:
        spec = ModelSpec.preset(name)
    config = model_config_from_spec(spec)
    return spec, config, init_params(config)


@dataclasses.dataclass(frozen=True)
class Case:
    """One random-workload run: a model, cache settings and a workload seed.

    ``pool``: ``max_total_tokens`` (small ones force eviction and retraction); ``states``:
    ``max_mamba_cache_size`` for recurrent models; ``host``/``storage``: the host tier, and the
    storage tier under it (a directory the test gives)."""

    model: str
    seed: int
    page_size: int = 1
    pool: int = 256
    policy: str = "lru"
    chunk: int = 32
    batch: int = 4
    requests: int = 10
    host: bool = False
    storage: bool = False
    extra_buffer: bool = False
    states: int | None = None
    running: int = 8
    expect: frozenset[str] = frozenset()  # what the run must do: see EXPECTATIONS

    def __str__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name != "expect"]
        return "Case(" + ", ".join(fields) + ")"


def _host_ext(sched: Scheduler) -> Any:
    return next((e for e in sched.extensions if isinstance(e, HostTierExtension)), None)


# What a case may be required to exercise (``Case.expect``), read off its warm scheduler.
EXPECTATIONS = {
    "evict": lambda s: s.stats.evicted_tokens > 0,
    "retract": lambda s: s.stats.retractions > 0,
    "reuse": lambda s: s.stats.cached_tokens > 0,
    "checkpoint_evict": lambda s: s.cache.tree_cache.mamba.num_evicted > 0,
    "host_load": lambda s: _host_ext(s).loaded_tokens > 0,
    "storage_prefetch": lambda s: _host_ext(s).prefetched_tokens > 0,
}


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request of a workload: its prompt (a follow-up turn's prompt is completed at run time
    with the previous turn's prompt and output in front), its output length, and when it arrives."""

    rid: str
    tokens: tuple[int, ...]
    max_new_tokens: int
    arrival: int  # step index; follow-ups arrive when their previous turn finishes
    follows: str | None = None


def draw_workload(seed: int, *, requests: int, max_kv: int, vocab: int = VOCAB) -> list[Turn]:
    """A random workload (see the module docstring) whose every request, follow-ups included,
    holds at most ``max_kv`` tokens of KV (prompt + output - 1)."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(1, vocab, n))

    prefixes = [draw(int(rng.integers(4, 33))) for _ in range(int(rng.integers(1, 4)))]
    turns: list[Turn] = []
    for i in range(requests):
        kind = rng.random()
        out = int(rng.integers(1, 7))
        if kind < 0.55:
            tokens = prefixes[int(rng.integers(len(prefixes)))] + draw(int(rng.integers(1, 13)))
        elif kind < 0.65 and turns:
            prev = turns[int(rng.integers(len(turns)))]
            if prev.follows is not None:
                tokens = draw(int(rng.integers(1, 30)))
            else:
                tokens, out = prev.tokens, prev.max_new_tokens  # an exact repeat
        else:
            tokens = draw(int(rng.integers(1, 30)))
        tokens = tokens[: max(1, max_kv // 2 - out)]
        arrival = int(rng.integers(0, 10))
        turns.append(Turn(f"r{i}", tokens, out, arrival))
        # Multi-turn: up to two follow-ups, while the conversation stays within max_kv.
        length = len(tokens) + out
        parent = f"r{i}"
        for t in range(int(rng.integers(0, 3))):
            new = draw(int(rng.integers(1, 9)))
            out = int(rng.integers(1, 7))
            if length + len(new) + out - 1 > max_kv:
                break
            rid = f"r{i}.{t + 1}"
            turns.append(Turn(rid, new, out, -1, follows=parent))
            length += len(new) + out
            parent = rid
    return turns


def build_scheduler(case: Case, *, cold: bool = False, storage_dir: str | None = None) -> Scheduler:
    """The case's cache and scheduler (``cold``: the radix cache off, no host tier)."""
    spec, config, params = model(case.model)
    settings: dict[str, Any] = dict(
        page_size=case.page_size,
        max_total_tokens=case.pool,
        max_running_requests=case.running,
        context_length=CONTEXT,
        chunked_prefill_size=case.chunk,
        radix_eviction_policy=case.policy,
        disable_radix_cache=cold,
    )
    if case.extra_buffer:
        settings["enable_mamba_extra_buffer"] = True
    if case.states is not None:
        settings["max_mamba_cache_size"] = case.states
    if case.host and not cold:
        settings["enable_hierarchical_cache"] = True
        if case.storage:
            assert storage_dir is not None, "a storage-tier case needs a directory"
            settings.update(
                hicache_storage_backend="file",
                hicache_storage_dir=storage_dir,
                hicache_storage_prefetch_policy="wait_complete",  # deterministic: no timing
                hicache_storage_prefetch_threshold=4,
                hicache_storage_model_fingerprint=random_weights_fingerprint(config, 0),
            )
    cache = build_kv_cache(spec, CacheConfig(**settings))
    return Scheduler(config, cache, params, max_batch_size=case.batch, chunked_prefill_size=case.chunk)


def check_step(sched: Scheduler) -> None:
    """Every invariant of the module docstring, after one step."""
    cache, alloc, tree, rows = sched.cache, sched.alloc, sched.tree, sched.rows
    for part in (alloc, rows):
        check = getattr(part, "check_invariants", None)
        if check is not None:
            check()
    tree.sanity_check()
    live = sched.live_requests()
    if not isinstance(alloc, SWATokenToKVPoolAllocator) and not cache.is_hybrid_swa:
        ps = sched.page_size
        held = 0
        for req in live:
            if req.req_pool_idx is None:
                continue  # a state slot, no row: holds no KV of its own
            held += -(-req.kv_len() // ps) * ps - req.cache_protected_len
        accounted = alloc.available_size() + tree.evictable_size() + tree.protected_size() + held
        assert accounted == alloc.size, (
            f"token accounting: available {alloc.available_size()} + evictable {tree.evictable_size()} + "
            f"protected {tree.protected_size()} + held by requests {held} != capacity {alloc.size}"
        )
    table = cache.req_to_token_pool
    if isinstance(table, HybridReqToTokenPool):
        held = 0
        for req in live:
            held += req.mamba_pool_idx is not None
            if req.mamba_ping_pong_track_buffer is not None:
                held += len(req.mamba_ping_pong_track_buffer)
        in_tree = tree.mamba_evictable_size() + tree.mamba_protected_size() if isinstance(tree, MambaRadixCache) else 0
        free = table.mamba_allocator.available_size()
        assert free + in_tree + held == table.mamba_pool_size, (
            f"state slots: free {free} + checkpoints {in_tree} + held by requests {held} != {table.mamba_pool_size}"
        )
    ext = _host_ext(sched)
    if ext is not None:
        assert ext.host_balanced(), "host pool: available + evictable + protected + held != capacity"
        host_check = getattr(ext.tree.host_allocator, "check_invariants", None)
        if host_check is not None:
            host_check()


def drive(sched: Scheduler, turns: list[Turn], *, check: bool = True) -> dict[str, list[int]]:
    """Serve ``turns`` (arrivals by step, follow-ups when their previous turn finishes), checking
    every invariant after every step; return each request's output by name."""
    first = sorted((t for t in turns if t.follows is None), key=lambda t: t.arrival)
    followers = {t.follows: t for t in turns if t.follows is not None}
    prompts: dict[str, tuple[int, ...]] = {}
    outputs: dict[str, list[int]] = {}
    ready: list[ServingReq] = []
    step = 0
    while first or ready or not sched.idle:
        while first and (first[0].arrival <= step or (sched.idle and not ready)):
            t = first.pop(0)
            prompts[t.rid] = t.tokens
            ready.append(ServingReq(t.rid, t.tokens, max_new_tokens=t.max_new_tokens))
        if ready:
            sched.submit(ready)
            ready = []
        for req in sched.step():
            rid = str(req.rid)
            outputs[rid] = list(req.output_ids)
            nxt = followers.get(rid)
            if nxt is not None:
                prompt = prompts[rid] + tuple(req.output_ids) + nxt.tokens
                prompts[nxt.rid] = prompt
                ready.append(ServingReq(nxt.rid, prompt, max_new_tokens=nxt.max_new_tokens))
        if check:
            check_step(sched)
        step += 1
        assert step < MAX_STEPS, f"no end after {MAX_STEPS} steps"
    return outputs


def check_end(sched: Scheduler) -> None:
    """Leak-free once every request is done: tokens (per side for hybrid SWA), rows, state slots."""
    assert sched.idle
    assert sched.leak_free(), "leak: available + evictable + protected != capacity, or a row held"
    ext = _host_ext(sched)
    if ext is not None:
        ext.tree.check_transfers(wait=True)
        assert ext.host_balanced(), "host pool: available + evictable + protected + held != capacity"
        ext.tree.sanity_check()
    table = sched.cache.req_to_token_pool
    if isinstance(table, HybridReqToTokenPool):
        tree = sched.tree
        in_tree = tree.mamba_evictable_size() + tree.mamba_protected_size() if isinstance(tree, MambaRadixCache) else 0
        assert table.mamba_allocator.available_size() + in_tree == table.mamba_pool_size, "a state slot leaked"


def max_kv(case: Case) -> int:
    """The most KV one request of the case may hold: the pool (whole pages) and the context."""
    return min(case.pool, CONTEXT) - case.page_size


def run_case(case: Case, *, storage_dir: str | None = None) -> Scheduler:
    """Serve the case's workload warm (checked after every step, leak-free at the end), then cold
    (the radix cache off); assert both gave every request the same tokens. Returns the warm
    scheduler. Any failure names the case (its seed included)."""
    turns = draw_workload(case.seed, requests=case.requests, max_kv=max_kv(case))
    try:
        warm = build_scheduler(case, storage_dir=storage_dir)
        warm_out = drive(warm, turns)
        check_end(warm)
        cold = build_scheduler(case, cold=True)
        cold_out = drive(cold, turns, check=False)
        check_end(cold)
        assert len(warm_out) == len(turns)
        diff = {rid: (warm_out[rid], cold_out.get(rid)) for rid in warm_out if warm_out[rid] != cold_out.get(rid)}
        assert not diff, f"cold != warm (warm, cold): {diff}"
        missed = sorted(e for e in case.expect if not EXPECTATIONS[e](warm))
        assert not missed, f"the run did not {missed}: {warm.stats}"
    except Exception as e:
        e.add_note(f"random workload {case}")
        raise
    return warm
