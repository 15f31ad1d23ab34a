"""Recurrent-state caching: what checkpoints buy and what they cost. Prints one JSON object.

* ``hit_rate``: the multi-turn workload of ``radix_workloads.py`` (each turn's prompt = the
  previous prompt + output + new tokens) through ``MambaRadixCache`` under each checkpoint policy
  (``kvjax.radix.checkpoint_policy``), with chunked prefill, next to the full-attention upper bound
  (the same stream through ``RadixCache``: every cached token is reusable). Per request: match and
  lock, prefill in chunks from the hit (each chunk end, then the prompt end, is a caching point),
  finish (prompt + output), unlock, evict to the token capacity; a checkpoint that finds no free
  state slot evicts the least recent one.
* ``per_request_cost``: µs per request of ``replay`` (match, lock, insert, unlock, evict) for the
  full-only tree and the Mamba tree (one checkpoint per insert), on both workloads; best of 5
  alternated runs each. On the shared-prefix workload the Mamba tree hits nothing: the only
  checkpoints are at the ends of requests, never at the shared system prompt (SGLang's
  ``mamba_branching_seqlen`` names the branch point a request would have to checkpoint).
* ``fork_cost``: one state-slot fork (copy-on-write) under ``jit`` with donation in a small and a
  large pool, alternating rounds, min and median: in place when the ratio of the minima stays near
  1; the same fork without donation (a whole-pool copy) is printed for scale.

    python benchmarks/recurrent_state.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ``python benchmarks/recurrent_state.py``

from benchmarks._common import machine, median_seconds  # noqa: E402
from benchmarks.radix_workloads import Request, TreeOps, kvjax_ops, multi_turn, replay, workloads
from kvjax.alloc.state_slots import StateSlotAllocator
from kvjax.radix import MambaRadixCache, RadixCache
from kvjax.radix.checkpoint_policy import POLICIES, CheckpointPolicy


def _state_slot(tree: MambaRadixCache, states: StateSlotAllocator) -> int:
    got = states.alloc(1)
    if got is None:
        tree.evict(num_tokens=0, mamba_num=1)
        got = states.alloc(1)
    assert got is not None, "the state pool is too small for one request"
    return int(got[0])


def _checkpoint(tree: MambaRadixCache, states: StateSlotAllocator, key: list[int], keep: bool) -> None:
    slot = _state_slot(tree, states) if keep else None
    result = tree.insert(key, mamba_value=slot)
    if slot is not None and result.mamba_exist:
        states.free([slot])


def simulate_policy(
    stream: list[Request],
    policy: CheckpointPolicy | None,
    *,
    capacity: int,
    state_slots: int,
    chunk: int,
    branch_points: bool = False,
) -> dict[str, Any]:
    """Hit rate of ``stream`` under ``policy`` (None: the full-attention tree, no states).

    ``branch_points``: also checkpoint where the FULL hit goes past the reusable checkpoint
    (SGLang's ``mamba_branching_seqlen``): the first chunk ends there and donates a state, so the
    next request branching at the same point (a shared system prompt) reuses it. kvjax's scheduler
    does not split the first chunk there; this simulates what doing so buys."""
    prompt_tokens = hit = 0
    if policy is None:
        full = RadixCache(page_size=1)
        for req in stream:
            m = full.match_prefix(req.prompt)
            hit += m.prefix_len
            prompt_tokens += len(req.prompt)
            receipt = full.inc_lock_ref(m.last_node)
            full.insert(req.full)
            full.dec_lock_ref(receipt)
            over = full.total_size() - capacity
            if over > 0:
                full.evict(over)
        return {"hit_rate": round(hit / prompt_tokens, 4), "hit_tokens": hit, "prompt_tokens": prompt_tokens}
    states = StateSlotAllocator(state_slots)
    tree = MambaRadixCache(page_size=1, mamba_pool_size=states)
    full_kv_hits = 0
    for req in stream:
        prompt = req.prompt
        m = tree.match_prefix(prompt)
        hit += m.prefix_len
        full_kv_hits += m.full_kv_hit_length
        prompt_tokens += len(prompt)
        receipt = tree.inc_lock_ref(m.last_node)
        pos = m.prefix_len
        branch = m.extras["mamba"].branching_seqlen if branch_points else None
        while pos < len(prompt):  # chunked prefill from the hit
            end = min(pos + chunk, len(prompt))
            if branch is not None and pos < branch < end:
                _checkpoint(tree, states, prompt[:branch], True)
                pos = branch
                continue
            point = "prompt_end" if end == len(prompt) else "chunk_ends"
            _checkpoint(tree, states, prompt[:end], policy.keeps(point))
            pos = end
        _checkpoint(tree, states, req.full, policy.keeps("turn_end"))
        tree.dec_lock_ref(receipt)
        over = tree.total_size() - capacity
        if over > 0:
            tree.evict(num_tokens=over)
    tree.sanity_check()
    return {
        "hit_rate": round(hit / prompt_tokens, 4),
        "hit_tokens": hit,
        "full_kv_hit_tokens": full_kv_hits,
        "prompt_tokens": prompt_tokens,
        "checkpoints_held": tree.mamba_evictable_size() + tree.mamba_protected_size(),
    }


def mamba_ops(tree: MambaRadixCache, states: StateSlotAllocator) -> TreeOps:
    """``TreeOps`` for the Mamba tree: every insert donates a checkpoint (SGLang's finish)."""

    def match(tokens: Any) -> tuple[int, Any]:
        m = tree.match_prefix(tokens)
        return m.prefix_len, m.last_node

    def insert(tokens: Any, values: Any) -> int:
        slot = _state_slot(tree, states)
        result = tree.insert(tokens, values, mamba_value=slot, donate_key=True)
        if result.mamba_exist:
            states.free([slot])
        return result.prefix_len

    return TreeOps(
        match=match,
        lock=tree.inc_lock_ref,
        unlock=lambda node, handle: tree.dec_lock_ref(handle),
        insert=insert,
        evict=lambda n: int(tree.evict(num_tokens=n)),
        cached_size=lambda: tree.evictable_size() + tree.protected_size(),
        prepare_tokens=list,  # keys donated, as ``kvjax_ops`` does for the full tree beside it
    )


REPEATS = 5


def per_request_cost(quick: bool, capacity: int, state_slots: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, stream in workloads(quick).items():
        fulls, mambas = [], []
        for _ in range(REPEATS):  # alternated, best of each: the machine may be shared
            fulls.append(replay(kvjax_ops(RadixCache(page_size=1)), stream, capacity=capacity, page_size=1))
            states = StateSlotAllocator(state_slots)
            tree = MambaRadixCache(page_size=1, mamba_pool_size=states)
            mambas.append(replay(mamba_ops(tree, states), stream, capacity=capacity, page_size=1))
        full = min(fulls, key=lambda r: r["us_per_request"])
        mamba = min(mambas, key=lambda r: r["us_per_request"])
        out[name] = {
            "full_only_us_per_request": full["us_per_request"],
            "mamba_us_per_request": mamba["us_per_request"],
            "ratio": round(mamba["us_per_request"] / full["us_per_request"], 2),
            "full_only_hit_tokens": full["hit_tokens"],
            "mamba_hit_tokens": mamba["hit_tokens"],
        }
    return out


def fork_cost(small: int, large: int, rounds: int = 200) -> dict[str, Any]:
    """One fork under ``jit`` with the pool donated, in a small and a large pool, measured in
    alternating rounds (min and median of ``rounds`` each: the minimum is the figure least
    disturbed by other work on a shared machine); and, for scale, the same fork without donation
    in the large pool, which copies the whole pool."""
    import jax

    from kvjax.pools.recurrent import RecurrentStatePool

    fork = jax.jit(lambda p, s, d: p.fork(s, d), donate_argnums=0)
    fork_copying = jax.jit(lambda p, s, d: p.fork(s, d))
    src, dst = np.array([1], np.int32), np.array([2], np.int32)
    pools = {
        label: RecurrentStatePool.create(
            num_slots=slots,
            layer_ids=(0, 1),
            conv_state_shapes=((256, 3),),
            ssm_state_shape=(4, 32, 32),
            conv_dtype="bfloat16",
            ssm_dtype="float32",
        )
        for label, slots in (("small", small), ("large", large))
    }
    times: dict[str, list[float]] = {"small": [], "large": []}
    for label in pools:  # compile and warm up
        for _ in range(3):
            pools[label] = fork(pools[label], src, dst)
        pools[label].ssm.block_until_ready()
    for _ in range(rounds):
        for label in ("small", "large"):
            start = time.perf_counter()
            pools[label] = fork(pools[label], src, dst)
            pools[label].ssm.block_until_ready()
            times[label].append(time.perf_counter() - start)
    copying = median_seconds(lambda: fork_copying(pools["large"], src, dst).ssm.block_until_ready(), repeats=5)
    out: dict[str, Any] = {}
    for label in ("small", "large"):
        t = sorted(times[label])
        out[label] = {
            "slots": pools[label].num_slots,
            "pool_mib": round(pools[label].nbytes() / 2**20, 1),
            "us_per_fork_min": round(t[0] * 1e6, 1),
            "us_per_fork_median": round(t[len(t) // 2] * 1e6, 1),
        }
    out["ratio_large_over_small"] = round(out["large"]["us_per_fork_min"] / out["small"]["us_per_fork_min"], 2)
    out["in_place"] = out["ratio_large_over_small"] <= 1.3
    out["large_without_donation_us"] = round(copying * 1e6, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests, a smaller large pool")
    args = parser.parse_args()
    quick = args.quick
    started = time.perf_counter()
    conversations = 8 if quick else 32
    stream = multi_turn(conversations=conversations)
    chunk, capacity, state_slots = 256, 200_000, 4 * conversations
    hit: dict[str, Any] = {
        "full_attention_upper_bound": simulate_policy(stream, None, capacity=capacity, state_slots=0, chunk=chunk)
    }
    for name, policy in POLICIES.items():
        hit[name] = simulate_policy(stream, policy, capacity=capacity, state_slots=state_slots, chunk=chunk)
    branching = {
        name: {
            "without_branch_points": simulate_policy(
                stream_, POLICIES["all"], capacity=capacity, state_slots=state_slots, chunk=chunk
            )["hit_rate"],
            "with_branch_points": simulate_policy(
                stream_, POLICIES["all"], capacity=capacity, state_slots=state_slots, chunk=chunk, branch_points=True
            )["hit_rate"],
            "full_attention_upper_bound": simulate_policy(stream_, None, capacity=capacity, state_slots=0, chunk=chunk)[
                "hit_rate"
            ],
        }
        for name, stream_ in workloads(quick).items()
    }
    tight = {
        name: simulate_policy(stream, POLICIES[name], capacity=capacity, state_slots=conversations, chunk=chunk)
        for name in ("all", "turn_end", "prompt_and_turn_end")
    }
    result = {
        "benchmark": "recurrent_state",
        "machine": machine(),
        "hit_rate": {
            "workload": f"multi_turn: {conversations} conversations x 6 turns, 200 new + 100 output tokens per turn",
            "chunked_prefill_size": chunk,
            "token_capacity": capacity,
            "state_slots": state_slots,
            "policies": hit,
            "state_slots_one_per_conversation": tight,
            "branch_point_checkpoints": branching,
        },
        "per_request_cost": per_request_cost(quick, capacity=capacity, state_slots=4 * conversations),
        "fork_cost": fork_cost(64, 1024 if quick else 4096),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
