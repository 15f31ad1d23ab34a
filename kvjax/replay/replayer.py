"""`replay_trace`: a trace's requests, in arrival order, through kvjax's own caches (no device).

The concurrency model is the simplest faithful one: requests are served **one at a time**, in
arrival order, each to completion (``rank.py``): its prompt and every output token must fit in
the device cache beside what its own matched prefix locks, and the cache holds nothing else
then. A served request leaves its prompt and outputs in the tree, so the cache sees the trace's
reuse pattern exactly; it does not see the memory that concurrently running requests would
take (a real server's cache is smaller by their share), nor reordering by the scheduler.

DP ranks: each rank has its own tree, allocator and host tier of the configured sizes; a
``kvjax.serve.dp_router.DPRouter`` over the ranks' trees picks a rank per request. Its load
signal (cache-aware routing) follows the trace's clock: a request counts in its rank's load
(``RankLoad``: its prompt + output tokens, and one request) from its arrival until
``dp_load_window_ms`` later, the requests a server would still be running.

Jax-free and host-only.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import numpy as np

from kvjax.radix.eviction import EvictionPolicy
from kvjax.replay.belady import OPTIMUM, BeladyPolicy
from kvjax.replay.future_use import FutureUses
from kvjax.replay.rank import ReplayRank
from kvjax.replay.replay_config import ReplayConfig
from kvjax.replay.result import PositionStats, ReplayResult
from kvjax.replay.sessions import POSITION_BUCKETS, position_bucket, session_positions
from kvjax.replay.trace import Trace
from kvjax.serve.dp_router import DPRouter, RankLoad

__all__ = ["replay_trace"]


def replay_trace(
    trace: Trace,
    config: ReplayConfig,
    *,
    positions: np.ndarray | None = None,
    on_request: Callable[[], None] | None = None,
) -> ReplayResult:
    """Replay every request of ``trace`` through the caches of ``config`` (module docstring).

    Args:
        trace: the requests, replayed in their order.
        config: the cache per rank, the eviction policy (``"belady"``: the offline optimum,
            with next uses read from ``trace``) and the routing.
        positions: each request's session position (``sessions.session_positions``); computed
            when not given (pass it to share the work between replays of one trace).
        on_request: called after each request (a progress bar).

    Returns:
        The replay's `ReplayResult`.
    """
    if positions is None:
        positions = session_positions(trace)[1]
    policy: str | EvictionPolicy = config.eviction_policy
    oracle: BeladyPolicy | None = None
    if config.eviction_policy == OPTIMUM:
        oracle = BeladyPolicy(FutureUses(trace, config.page_size), config.page_size)
        policy = oracle
    longest = max((r.input_length + r.output_length for r in trace.requests), default=1)
    ranks = [
        ReplayRank(config.capacity_tokens, config.page_size, policy, config.host_capacity_tokens, longest)
        for _ in range(config.dp_size)
    ]
    router = DPRouter([r.tree for r in ranks], config.dp_routing, max_load_gap_tokens=config.dp_max_load_gap_tokens)
    result = ReplayResult(
        policy=config.eviction_policy,
        page_size=config.page_size,
        capacity_tokens=ranks[0].allocator.size,
        host_capacity_tokens=config.host_capacity_tokens - config.host_capacity_tokens % config.page_size,
        dp_size=config.dp_size,
        dp_routing=config.dp_routing if config.dp_size > 1 else None,
        per_rank_requests=[0] * config.dp_size,
        per_rank_hit_tokens=[0] * config.dp_size,
    )
    buckets = {position_bucket(lo): PositionStats() for lo, _ in POSITION_BUCKETS}
    in_flight: collections.deque[tuple[float, int, int]] = collections.deque()  # (arrival ms, rank, tokens)
    loads = [[0, 0] for _ in ranks]
    start = time.perf_counter()
    for index, req in enumerate(trace.requests):
        prompt = trace.prompt_tokens(index)
        rank = 0
        if config.dp_size > 1:
            while in_flight and in_flight[0][0] <= req.timestamp_ms - config.dp_load_window_ms:
                _, done_rank, tokens = in_flight.popleft()
                loads[done_rank][0] -= tokens
                loads[done_rank][1] -= 1
            rank = router.route(prompt, [RankLoad(t, n) for t, n in loads])
            work = req.input_length + req.output_length
            in_flight.append((req.timestamp_ms, rank, work))
            loads[rank][0] += work
            loads[rank][1] += 1
        if oracle is not None:
            oracle.now = index
        outcome = ranks[rank].serve(index, prompt, trace.output_tokens(index))
        hits = outcome.device_hit_tokens + outcome.host_hit_tokens if outcome.served else 0
        result.requests += 1
        result.too_large += not outcome.served
        result.prompt_tokens += req.input_length
        if outcome.served:
            result.device_hit_tokens += outcome.device_hit_tokens
            result.host_hit_tokens += outcome.host_hit_tokens
        result.per_rank_requests[rank] += 1
        result.per_rank_hit_tokens[rank] += hits
        bucket = buckets[position_bucket(int(positions[index]))]
        bucket.requests += 1
        bucket.prompt_tokens += req.input_length
        bucket.hit_tokens += hits
        if on_request is not None:
            on_request()
    result.seconds = time.perf_counter() - start
    result.by_position = {k: v for k, v in buckets.items() if v.requests}
    for r in ranks:
        result.evicted_tokens += r.evicted_tokens
        result.evicted_nodes += r.evicted_nodes
        result.peak_device_tokens = max(result.peak_device_tokens, r.peak_used_tokens)
        if r.engine is not None:
            result.host_backed_up_tokens += r.engine.backed_up_tokens
            result.host_loaded_tokens += r.engine.loaded_tokens
    return result
