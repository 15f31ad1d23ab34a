"""Prefix-cache hit rate of DP-attention routing: round robin (SGLang) against cache-aware.

Under DP attention each DP rank owns its own prefix tree, allocator and request table, so a
request reuses a cached prefix only on the rank that holds it. This replays request streams
through ``dp`` such ranks (real kvjax ``RadixCache`` trees, paged allocators and request tables;
host only, no model) with each routing policy of ``kvjax.serve.dp_router``, and reports the hit
rate: prompt tokens served from the cache over all prompt tokens (the demo's hit rate).

Per request, as the serving scheduler does: the router picks a rank from the request's prompt
and every rank's load; the rank admits it (``match_and_lock``, fresh slots for the rest of the
prompt, evicting what is missing) and caches the prompt right after its prefill
(``cache_unfinished_req``, so later requests can share it while it decodes); when it finishes,
its output tokens get slots and ``cache_finished_req`` inserts prompt and output. At most
``in_flight`` requests run at once over all ranks; admitting one more first finishes the oldest.
A rank's load is the KV tokens (prompt and output) of its running requests. Output tokens are
drawn from a seeded generator (no model): a pure function of the request.

Workloads:

* ``demo``: the demo's (``kvjax.serve.workload.Workload()``, ``python -m kvjax demo``): 4 groups
  of 6 requests sharing a 256-token system prompt, interleaved across groups, plus 4 chats of
  3 turns (each turn's prompt holds the previous turn's prompt and output; a turn arrives when
  the previous one finishes).
* ``multi_tenant``: 16 tenants, each with a 1,024-token system prompt, and 384 short questions;
  each request's tenant is drawn from a seeded generator, so tenants interleave irregularly (as
  live traffic does). The tenants' prompts fill one rank's pool: round robin makes every rank
  cache every tenant and evict, cache-aware routing splits the tenants over the ranks.

On the demo both policies reach the same hit rate: its requests interleave the groups strictly
(``g0, g1, g2, g3, g0, ...``), so with a group count that is a multiple of ``dp`` round robin
sends every group to one rank anyway, and a chat's turns return to their rank in order.

Run: ``python benchmarks/dp_routing.py`` (JSON on stdout; a few seconds, host only).
``routing_hit_rates(dp)`` is the figure other benchmarks import.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Iterator

import numpy as np

from kvjax.alloc import make_allocator
from kvjax.radix import RadixCache
from kvjax.req_pool import ReqToTokenPool
from kvjax.request import Req
from kvjax.serve.dp_router import DEFAULT_MAX_LOAD_GAP_TOKENS, ROUTING_POLICIES, DPRouter, RankLoad
from kvjax.serve.workload import Workload

PAGE_SIZE = 16  # the demo's
POOL_TOKENS_PER_RANK = 16384  # the demo's pool (max_total_tokens), on every rank
ROWS_PER_RANK = 64
CONTEXT = 2048


@dataclasses.dataclass(frozen=True)
class SimRequest:
    """One request of a stream: its id, prompt and the tokens it will generate."""

    rid: str
    prompt: list[int]
    output: list[int]


@dataclasses.dataclass(frozen=True)
class Stream:
    """A workload as a request stream: the requests that arrive first, in order, and the request
    (if any) that arrives when a given one finishes (a chat's next turn)."""

    first: list[SimRequest]
    follow_up: Callable[[SimRequest], SimRequest | None]


def demo_stream(workload: Workload | None = None) -> Stream:
    """The demo's workload, drawn as ``kvjax.serve.workload.run_workload`` draws it; outputs
    drawn from a second generator of the same seed."""
    w = workload or Workload()
    rng = np.random.default_rng(w.seed)
    out_rng = np.random.default_rng([w.seed, 1])

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, w.vocab_size, n)]

    def output() -> list[int]:
        return [int(t) for t in out_rng.integers(0, w.vocab_size, w.output_tokens)]

    systems = [draw(w.system_tokens) for _ in range(w.groups)]
    first = []
    for i in range(w.prompts_per_group):
        for g in range(w.groups):
            first.append(SimRequest(f"g{g}.{i}", systems[g] + draw(w.question_tokens), output()))
    turns = [[draw(w.turn_tokens) for _ in range(w.turns)] for _ in range(w.chats)]
    for c in range(w.chats):
        first.append(SimRequest(f"c{c}.0", turns[c][0], output()))

    def follow_up(done: SimRequest) -> SimRequest | None:
        if not done.rid.startswith("c"):
            return None
        chat, turn = (int(x) for x in done.rid[1:].split("."))
        if turn + 1 >= w.turns:
            return None
        prompt = done.prompt + done.output + turns[chat][turn + 1]
        return SimRequest(f"c{chat}.{turn + 1}", prompt, output())

    return Stream(first, follow_up)


def multi_tenant_stream(
    *, tenants: int = 16, requests: int = 384, system_tokens: int = 1024, question_tokens: int = 32, seed: int = 0
) -> Stream:
    """``requests`` requests; each picks a tenant at random (seeded) and asks a fresh question
    after that tenant's ``system_tokens``-token system prompt; 16 output tokens each."""
    rng = np.random.default_rng([seed, 2])
    vocab = 32_000  # no accidental sharing between tenants or questions

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, n)]

    systems = [draw(system_tokens) for _ in range(tenants)]
    first = []
    for i in range(requests):
        tenant = int(rng.integers(0, tenants))
        first.append(SimRequest(f"t{tenant}.{i}", systems[tenant] + draw(question_tokens), draw(16)))
    return Stream(first, lambda _done: None)


class _Rank:
    """One DP rank's host state: its tree, allocator and request table, and its running requests."""

    def __init__(self, pool_tokens: int, page_size: int) -> None:
        self.page_size = page_size
        self.allocator = make_allocator(pool_tokens, page_size)
        self.capacity = self.allocator.available_size()
        self.rows = ReqToTokenPool(ROWS_PER_RANK, CONTEXT)
        self.tree = RadixCache(
            page_size=page_size, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.allocator
        )
        self.running: dict[str, tuple[Req, SimRequest]] = {}
        self.load_tokens = 0

    def load(self) -> RankLoad:
        return RankLoad(self.load_tokens, len(self.running))

    def admit(self, request: SimRequest) -> int:
        """Match, lock and allocate the prompt, cache it as after its prefill; the prompt
        tokens served from the tree."""
        rows = self.rows.alloc(1)
        if rows is None:
            raise RuntimeError(f"rank out of request rows ({ROWS_PER_RANK}); lower in_flight")
        req = Req(request.rid, list(request.prompt), req_pool_idx=rows[0])
        match = self.tree.match_and_lock(req)
        self.rows.write(rows[0], 0, match.indices)
        self._extend(req, match.prefix_len, len(request.prompt))
        self.tree.cache_unfinished_req(req)
        self.running[request.rid] = (req, request)
        self.load_tokens += len(request.prompt) + len(request.output)
        return match.prefix_len

    def finish(self, rid: str) -> SimRequest:
        """Give the output tokens slots, insert prompt and output, free the row."""
        req, request = self.running.pop(rid)
        start = req.kv_len()
        req.output_ids.extend(request.output)
        self._extend(req, start, req.kv_len())
        self.tree.cache_finished_req(req)
        assert req.req_pool_idx is not None
        self.rows.free(req.req_pool_idx)
        self.load_tokens -= len(request.prompt) + len(request.output)
        return request

    def _extend(self, req: Req, start: int, end: int) -> None:
        """Slots for tokens ``[start, end)`` of ``req``: the rest of its last partial page, then
        fresh pages (evicting from the tree what is missing)."""
        ps = self.page_size
        row = req.req_pool_idx
        assert row is not None
        room = min((-start) % ps, end - start)
        first = self.rows.req_to_token[row, start - 1] + 1 + np.arange(room, dtype=np.int32) if room else []
        need = end - start - room
        pages = -(-need // ps) * ps
        if pages > self.allocator.available_size():
            self.tree.evict(pages - self.allocator.available_size())
        fresh = self.allocator.alloc(pages) if pages else np.zeros(0, np.int32)
        if fresh is None:
            raise RuntimeError(f"rank pool of {self.capacity} tokens too small for the running requests")
        self.rows.write(row, start, np.concatenate([np.asarray(first, np.int32), np.asarray(fresh, np.int32)[:need]]))

    def check_no_leak(self) -> None:
        """With nothing running: every slot is free or held by the tree, and nothing is locked."""
        tree = self.tree
        tree.sanity_check()
        assert tree.protected_size() == 0, tree.protected_size()
        assert self.allocator.available_size() + tree.evictable_size() == self.capacity


def simulate(
    stream: Stream,
    dp: int,
    policy: str,
    *,
    in_flight: int | None = None,
    max_load_gap_tokens: int = DEFAULT_MAX_LOAD_GAP_TOKENS,
    pool_tokens_per_rank: int = POOL_TOKENS_PER_RANK,
    page_size: int = PAGE_SIZE,
) -> dict:
    """Replay ``stream`` over ``dp`` ranks routed by ``policy``; hit rate and per-rank counts.

    ``in_flight``: requests running at once over all ranks (default ``4 * dp``).
    """
    ranks = [_Rank(pool_tokens_per_rank, page_size) for _ in range(dp)]
    router = DPRouter([r.tree for r in ranks], policy, max_load_gap_tokens=max_load_gap_tokens)
    window = 4 * dp if in_flight is None else in_flight
    arrivals: collections.deque[SimRequest] = collections.deque(stream.first)
    running: collections.deque[tuple[int, str]] = collections.deque()  # oldest first
    prompt_tokens = cached_tokens = 0
    per_rank = [0] * dp

    def finish_oldest() -> None:
        rank, rid = running.popleft()
        nxt = stream.follow_up(ranks[rank].finish(rid))
        if nxt is not None:
            arrivals.append(nxt)

    while arrivals or running:
        if not arrivals or len(running) >= window:
            finish_oldest()
            continue
        request = arrivals.popleft()
        rank = router.route(request.prompt, [r.load() for r in ranks])
        cached_tokens += ranks[rank].admit(request)
        prompt_tokens += len(request.prompt)
        per_rank[rank] += 1
        running.append((rank, request.rid))
    for r in ranks:
        r.check_no_leak()
    return {
        "hit_rate": cached_tokens / prompt_tokens,
        "cached_tokens": cached_tokens,
        "prompt_tokens": prompt_tokens,
        "requests_per_rank": per_rank,
        "evicted_tokens": sum(r.tree.stats.evicted_tokens for r in ranks),
    }


def _streams() -> Iterator[tuple[str, Stream]]:
    yield "demo", demo_stream()
    yield "multi_tenant", multi_tenant_stream()


def routing_hit_rates(dp: int) -> dict:
    """Hit rate of each routing policy at ``dp`` DP ranks, per workload, with the cache-aware
    to round-robin ratio and the shared-tree hit rate: one tree over all ``dp`` pools sees every
    request (what no routing over per-rank trees can beat).

    Returns ``{workload: {"round_robin": {...}, "cache_aware": {...}, "ratio": float,
    "shared_tree_hit_rate": float}}``; each policy's dict as ``simulate`` returns it.
    """
    out: dict = {}
    for name, stream in _streams():
        row: dict = {policy: simulate(stream, dp, policy) for policy in ROUTING_POLICIES}
        rr, ca = row["round_robin"]["hit_rate"], row["cache_aware"]["hit_rate"]
        row["ratio"] = ca / rr if rr else None
        shared = simulate(stream, 1, "round_robin", in_flight=4 * dp, pool_tokens_per_rank=dp * POOL_TOKENS_PER_RANK)
        row["shared_tree_hit_rate"] = shared["hit_rate"]
        out[name] = row
    return out


def main() -> None:
    result = {
        "what": "prefix-cache hit rate (cached prompt tokens / prompt tokens) per DP routing policy",
        "settings": {
            "page_size": PAGE_SIZE,
            "pool_tokens_per_rank": POOL_TOKENS_PER_RANK,
            "in_flight": "4 * dp requests over all ranks",
            "max_load_gap_tokens": DEFAULT_MAX_LOAD_GAP_TOKENS,
        },
        "dp": {str(dp): routing_hit_rates(dp) for dp in (2, 4)},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
