"""Request streams and the per-request replay loop for the radix-cache benchmarks.

`benchmarks/radix.py` (kvjax alone) and `benchmarks/compare_peers.py` (kvjax next to other
implementations) replay the same streams through the same loop, so their figures line up.

Per request the loop does what a scheduler does around a prefill:
``match_prefix(prompt)`` -> lock the matched node -> ``insert(prompt + output)`` -> unlock ->
evict until the tree holds at most ``capacity`` tokens. Insert keys are cut to a multiple of
the page size by the loop (as ``cache_finished_req`` does), so every implementation sees the
same page-aligned keys.

Token ids are drawn from a large vocabulary with a fixed seed: two different streams of 128
tokens never collide by chance, so every hit is a prefix the workload meant to share.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

VOCAB = 32_000


@dataclass(frozen=True)
class Request:
    """One request of a stream: its prompt and the tokens it generates."""

    prompt: list[int]
    output: list[int]
    # prompt + output, built once so that building it is not timed.
    full: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "full", self.prompt + self.output)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prefix(
    *,
    groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 1024,
    question_len: int = 128,
    output_len: int = 64,
    seed: int = 0,
) -> list[Request]:
    """Groups of prompts behind one system prompt each, shuffled with a fixed seed.

    Default: 64 groups x 16 prompts, a 1,024-token system prompt per group, a 128-token
    question and 64 output tokens per request (1,024 requests).
    """
    rng = random.Random(seed)
    stream = []
    for _ in range(groups):
        system = _tokens(rng, system_len)
        for _ in range(prompts_per_group):
            stream.append(Request(system + _tokens(rng, question_len), _tokens(rng, output_len)))
    rng.shuffle(stream)
    return stream


def multi_turn(
    *,
    conversations: int = 32,
    turns: int = 6,
    new_len: int = 200,
    output_len: int = 100,
    seed: int = 1,
) -> list[Request]:
    """Conversations whose each turn's prompt is the previous prompt + its output + new tokens.

    Default: 32 conversations x 6 turns, 200 new tokens per turn and 100 output tokens,
    interleaved turn by turn (every conversation's turn 1, then every turn 2, ...).
    """
    rng = random.Random(seed)
    history: list[list[int]] = [[] for _ in range(conversations)]
    stream = []
    for _ in range(turns):
        for c in range(conversations):
            prompt = history[c] + _tokens(rng, new_len)
            req = Request(prompt, _tokens(rng, output_len))
            history[c] = req.full
            stream.append(req)
    return stream


def workloads(quick: bool = False) -> dict[str, list[Request]]:
    """The two benchmark streams, full size or (``quick``) a quarter of the requests."""
    if quick:
        return {
            "shared_prefix": shared_prefix(groups=16),
            "multi_turn": multi_turn(conversations=8),
        }
    return {"shared_prefix": shared_prefix(), "multi_turn": multi_turn()}


def comparison_runs(quick: bool = False, capacity: int = 200_000) -> list[tuple[str, list[Request], int]]:
    """``(name, stream, capacity)`` for the side-by-side comparison: the two benchmark
    streams at ``capacity``, plus the shared-prefix stream at a fifth of it, where system
    prompts themselves get evicted and re-inserted, so the hit count depends on the exact
    eviction order (a sharper check that two LRU trees agree)."""
    streams = workloads(quick)
    return [
        ("shared_prefix", streams["shared_prefix"], capacity),
        ("multi_turn", streams["multi_turn"], capacity),
        ("shared_prefix_tight", streams["shared_prefix"], capacity // 5 // (4 if quick else 1)),
    ]


@dataclass
class TreeOps:
    """How the replay loop drives one implementation; each field is one call.

    ``match(tokens) -> (prefix_len, node)``, ``lock(node) -> handle``,
    ``unlock(node, handle)``, ``insert(tokens, values) -> already_cached_len``,
    ``evict(num_tokens) -> evicted``, ``cached_size() -> tokens in the tree`` (must be O(1):
    evictable + protected, not a tree walk).

    ``prepare_tokens`` / ``prepare_values`` turn the stream's Python lists and int32 numpy
    slot ids into what the implementation takes; they run before the clock starts.
    """

    match: Callable[[Any], tuple[int, Any]]
    lock: Callable[[Any], Any]
    unlock: Callable[[Any, Any], Any]
    insert: Callable[[Any, Any], int]
    evict: Callable[[int], int]
    cached_size: Callable[[], int]
    prepare_tokens: Callable[[list[int]], Any] = lambda tokens: tokens
    prepare_values: Callable[[np.ndarray], Any] = lambda values: values


def replay(ops: TreeOps, stream: list[Request], *, capacity: int, page_size: int) -> dict:
    """Replays ``stream`` through ``ops``; returns µs per request, hit and evicted tokens.

    Every request inserts its page-aligned ``prompt + output`` with slot ids of its own
    (page-structured, never 0, distinct across the stream), as ``cache_finished_req`` would.
    """
    prompts, keys, values = [], [], []
    next_slot = page_size  # page 0 is the trash page
    for req in stream:
        aligned = len(req.full) // page_size * page_size
        key = req.full if aligned == len(req.full) else req.full[:aligned]
        prompts.append(ops.prepare_tokens(req.prompt))
        keys.append(ops.prepare_tokens(key))
        values.append(ops.prepare_values(np.arange(next_slot, next_slot + aligned, dtype=np.int32)))
        next_slot += aligned
    match, lock, unlock, insert, evict, cached_size = (
        ops.match,
        ops.lock,
        ops.unlock,
        ops.insert,
        ops.evict,
        ops.cached_size,
    )
    hit = evicted = inserted_new = 0
    start = time.perf_counter()
    for prompt, key, value in zip(prompts, keys, values, strict=True):
        prefix_len, node = match(prompt)
        hit += prefix_len
        handle = lock(node)
        inserted_new += len(key) - insert(key, value)
        unlock(node, handle)
        over = cached_size() - capacity
        if over > 0:
            evicted += evict(over)
    elapsed = time.perf_counter() - start
    return {
        "requests": len(stream),
        "us_per_request": round(elapsed / len(stream) * 1e6, 2),
        "hit_tokens": hit,
        "evicted_tokens": evicted,
        "inserted_new_tokens": inserted_new,
        "final_cached_tokens": cached_size(),
    }


def kvjax_ops(tree) -> TreeOps:
    """`TreeOps` for a kvjax ``RadixCache`` (DESIGN §2 names).

    Keys are inserted with ``donate_key=True``: like SGLang's and sglang-jax's ``insert``, which
    keep the caller's key object as a new node's edge, the tree may keep the list instead of
    copying it (and may cut it later). ``prepare_tokens`` therefore gives every call a list of
    its own (the stream's lists are replayed again), as SGLang's gets an ``array('q')`` of its
    own; the copies are made before the clock starts and share the stream's token objects.
    """

    def match(tokens):
        m = tree.match_prefix(tokens)
        return m.prefix_len, m.last_node

    def unlock(node, _handle):
        tree.dec_lock_ref(node)

    return TreeOps(
        match=match,
        lock=tree.inc_lock_ref,
        unlock=unlock,
        insert=lambda tokens, values: tree.insert(tokens, values, donate_key=True),
        evict=tree.evict,
        cached_size=tree.total_size,  # evictable + protected, O(1) (SGLang's total_size walks the tree)
        prepare_tokens=list,
    )
