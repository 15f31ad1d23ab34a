"""KV events on the wire: prints one JSON object.

    python benchmarks/kv_events.py [--quick] [--repeats N]

* ``cost``: the radix benchmark's per-request loop (``radix_workloads``: ``match_prefix(prompt)``
  -> lock -> ``insert(prompt + output)`` -> unlock; no eviction) with KV events off and on,
  in one run, best of ``--repeats`` fresh trees each, alternating. "On" publishes every request's
  events as one batch (a scheduler step's worth) through a real ``ZmqEventPublisher`` (ipc, its
  encoding thread running) with a subscriber connected: the tree's page hashing, the bridge's
  conversion and the publisher's queueing and encoding all count. Per workload, page size (1, 16)
  and block hash (``kvjax``, ``sha256_cbor``): µs per request off and on and
  ``overhead = on / off - 1`` (goal: at most 0.05), and the tree's own part of "on" (page
  hashes and in-process events into a list, nothing converted or sent), the cost per new page,
  and ``repeat_fully_cached``: the same requests again on the warm tree, every page of every
  request cached (no new page, no event: the cost of events for a fully cached request; the best
  of ``REPEAT_PASSES`` passes per repeat, alternating off and on). In the first pass most
  requests are cached too (a hit on their system prompt or earlier turns,
  ``cached_request_share``), but each adds its question and output.
* ``throughput``: events per second from ``publish`` to a subscriber that decoded them all (one
  publisher, ipc, batches of one request's events, the encoding thread and the decoding
  subscriber on this machine's two cores).
* ``routing``: the demo workload (``kvjax.serve.workload.Workload()``: 4 groups x 6 prompts over
  256-token system prompts, 4 chats x 3 turns; and the same shape scaled to 6 groups and 6
  chats) over 4 DP ranks, each a radix tree of 16,384 tokens fed by the host-only loop above,
  each publishing its own stream (port-offset addresses, ``data_parallel_rank`` stamped). Hit
  rate (cached prompt tokens over prompt tokens) of: round robin; ``EventRouter``, which knows
  the ranks only from their event streams (a real ZMQ subscription per rank, ``sha256_cbor``
  hashes recomputed from token ids) and sends each request to the rank holding its longest
  hashed prefix (ties: the rank given the fewest requests); and ``DPRouter``'s ``cache_aware``,
  which reads the ranks' trees directly (the in-process reference; its load is the prompt tokens
  each rank was given so far, as requests finish at once here). Outputs are drawn from a seeded
  generator; before each routing decision the router reads its subscriptions until they hold
  every batch published so far (the benchmark waits for the network, the decision uses only the
  streams).

CPU figures on a shared 2-core machine; compare ratios, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))

import numpy as np  # noqa: E402
import radix_workloads as wl  # type: ignore[import-not-found]  # noqa: E402

from kvjax.kv_events.block_hash import Sha256CborHasher  # noqa: E402
from kvjax.kv_events.bridge import EventBridge  # noqa: E402
from kvjax.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from kvjax.kv_events.router import EventRouter  # noqa: E402
from kvjax.kv_events.subscriber import EventSubscriber  # noqa: E402
from kvjax.page_hash import PageHasher  # noqa: E402
from kvjax.radix import RadixCache  # noqa: E402
from kvjax.serve.dp_router import DPRouter, RankLoad  # noqa: E402
from kvjax.serve.workload import Workload  # noqa: E402

CAPACITY = 200_000
NO_EVICTION = 1 << 40  # the cost runs keep every page: a repeat pass is then fully cached
REPEAT_PASSES = 5  # fully cached passes per tree, alternating off and on
SEED = "0"


# --- cost -------------------------------------------------------------------------------------------


def _prepared(stream: list[Any], page_size: int) -> list[tuple[list[int], list[int], np.ndarray]]:
    out, next_slot = [], page_size
    for req in stream:
        aligned = len(req.full) // page_size * page_size
        out.append((req.prompt, req.full[:aligned], np.arange(next_slot, next_slot + aligned, dtype=np.int32)))
        next_slot += aligned
    return out


def _replay(tree: RadixCache, prepared: list, capacity: int, flush: Any) -> tuple[float, int, int]:
    """The radix loop over ``prepared`` (fresh key copies each run); seconds, cached requests,
    hit tokens."""
    keys = [list(k) for _, k, _ in prepared]
    cached = hits = 0
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for (prompt, _, value), key in zip(prepared, keys, strict=True):
            m = tree.match_prefix(prompt)
            cached += m.prefix_len > 0
            hits += m.prefix_len
            tree.inc_lock_ref(m.last_node)
            tree.insert(key, value, donate_key=True)
            tree.dec_lock_ref(m.last_node)
            over = tree.total_size() - capacity
            if over > 0:
                tree.evict(over)
            if flush is not None:
                flush()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return elapsed, cached, hits


def _hasher(name: str) -> Any:
    return PageHasher(0) if name == "kvjax" else Sha256CborHasher(SEED)


def bench_cost(stream: list[Any], page_size: int, block_hash: str, repeats: int, tmp: str) -> dict:
    prepared = _prepared(stream, page_size)
    off, on, hashing = [], [], []
    again_off, again_on = [], []
    events = batches = 0
    cached = hits = 0
    for r in range(repeats):
        tree_off = RadixCache(page_size=page_size)
        elapsed, cached, hits = _replay(tree_off, prepared, NO_EVICTION, None)
        off.append(elapsed)
        tree = RadixCache(page_size=page_size)
        sink: list = []
        tree.start_events(sink, _hasher(block_hash))  # events made, never converted nor sent
        hashing.append(_replay(tree, prepared, NO_EVICTION, sink.clear)[0])
        address = f"ipc://{tmp}/cost-{page_size}-{block_hash}-{r}"
        publisher = ZmqEventPublisher(address, max_queue_size=100_000)
        subscriber = EventSubscriber(address)
        time.sleep(0.2)
        tree_on = RadixCache(page_size=page_size)
        bridge = EventBridge(publisher, _hasher(block_hash))
        tree_on.start_events(bridge, bridge.hasher)
        elapsed, cached_on, hits_on = _replay(tree_on, prepared, NO_EVICTION, bridge.flush)
        on.append(elapsed)
        assert (cached_on, hits_on) == (cached, hits), "events change nothing the tree does"
        for _ in range(REPEAT_PASSES):  # both trees warm: alternate, the machine's noise shared
            again_off.append(_replay(tree_off, prepared, NO_EVICTION, None)[0])
            again_on.append(_replay(tree_on, prepared, NO_EVICTION, bridge.flush)[0])
        publisher.close()
        subscriber.close()
        events, batches = bridge.published_events, bridge.published_batches
    n = len(stream)
    new_pages = sum(len(k) for _, k, _ in prepared) // page_size - hits // page_size
    best_off, best_on = min(off) / n * 1e6, min(on) / n * 1e6
    return {
        "requests": n,
        "cached_request_share": round(cached / n, 3),
        "hit_tokens": hits,
        "events_per_request": round(events / n, 2),
        "batches": batches,
        "us_per_request_events_off": round(best_off, 2),
        "us_per_request_events_on": round(best_on, 2),
        "overhead": round(best_on / best_off - 1, 4),
        # of which the tree's own part: page hashes and in-process events, nothing published
        "us_per_request_tree_events_only": round(min(hashing) / n * 1e6, 2),
        "us_per_new_page_events_on": round((best_on - best_off) / max(new_pages / n, 1e-9), 2),
        # the same requests again on the warm tree: every page cached, no new page, no event
        "repeat_fully_cached": {
            "us_per_request_events_off": round(min(again_off) / n * 1e6, 2),
            "us_per_request_events_on": round(min(again_on) / n * 1e6, 2),
            "overhead": round(min(again_on) / min(again_off) - 1, 4),
        },
    }


# --- throughput -------------------------------------------------------------------------------------


def bench_throughput(stream: list[Any], page_size: int, tmp: str) -> dict:
    """Events per second from publish to a subscriber that decoded them all."""
    collected: list = []

    class Collect:
        def publish(self, batch: Any) -> None:
            collected.append(batch)

        def close(self) -> None:
            pass

    tree = RadixCache(page_size=page_size)
    bridge = EventBridge(Collect(), Sha256CborHasher(SEED))
    tree.start_events(bridge, bridge.hasher)
    _replay(tree, _prepared(stream, page_size), CAPACITY, bridge.flush)
    address = f"ipc://{tmp}/throughput"
    publisher = ZmqEventPublisher(address, max_queue_size=len(collected) + 1, hwm=0)
    subscriber = EventSubscriber(address)
    time.sleep(0.3)
    total_events = sum(len(b.events) for b in collected)
    received = 0
    start = time.perf_counter()
    for batch in collected:
        publisher.publish(batch)
    deadline = time.monotonic() + 60
    while subscriber.last_seq + 1 < len(collected) and time.monotonic() < deadline:
        received += sum(len(b.events) for _, b in subscriber.receive(0.05))
    elapsed = time.perf_counter() - start
    publisher.close()
    subscriber.close()
    return {
        "batches": len(collected),
        "events": total_events,
        "events_received": received,
        "lost_batches": subscriber.lost_batches,
        "seconds": round(elapsed, 3),
        "events_per_second": round(received / elapsed),
        "blocks_per_event": round(
            sum(len(e.block_hashes) for b in collected for e in b.events) / max(total_events, 1), 2
        ),
    }


# --- routing ----------------------------------------------------------------------------------------


class _Rank:
    """One DP rank, host-only: a radix tree (16,384 tokens) that caches each request's prompt and
    drawn output, publishing its events."""

    def __init__(self, page_size: int, capacity: int, publisher: Any = None) -> None:
        self.tree = RadixCache(page_size=page_size)
        self.page_size = page_size
        self.capacity = capacity
        self.bridge = None
        if publisher is not None:
            self.bridge = EventBridge(publisher, Sha256CborHasher(SEED))
            self.tree.start_events(self.bridge, self.bridge.hasher)

    def serve(self, prompt: list[int], output: list[int]) -> int:
        tree = self.tree
        m = tree.match_prefix(prompt)
        key = prompt + output
        key = key[: len(key) - len(key) % self.page_size]
        tree.inc_lock_ref(m.last_node)
        tree.insert(key)
        tree.dec_lock_ref(m.last_node)
        over = tree.total_size() - self.capacity
        if over > 0:
            tree.evict(over)
        if self.bridge is not None:
            self.bridge.flush()
        return m.prefix_len


def _demo_requests(workload: Workload) -> tuple[list[tuple[str, list[int]]], dict, Any]:
    """The demo workload's first requests (as ``run_workload`` submits them), its chats' later
    turns, and a seeded output generator."""
    rng = np.random.default_rng(workload.seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, workload.vocab_size, n)]

    systems = [draw(workload.system_tokens) for _ in range(workload.groups)]
    first = []
    for i in range(workload.prompts_per_group):
        for g in range(workload.groups):
            first.append((f"g{g}.{i}", systems[g] + draw(workload.question_tokens)))
    turns = {c: [draw(workload.turn_tokens) for _ in range(workload.turns)] for c in range(workload.chats)}
    for c in range(workload.chats):
        first.append((f"c{c}.0", turns[c][0]))
    return first, turns, random.Random(1)


def bench_routing(workload: Workload, policy: str, ranks: int, page_size: int, tmp: str, tag: str) -> dict:
    """The demo workload's requests, in ``run_workload``'s order (a chat's next turn queued when
    its turn is served), routed over ``ranks`` host-only ranks by ``policy``."""
    publishers, subscribers = [], []
    if policy == "events":
        base = f"ipc://{tmp}/route-{tag}"
        for r in range(ranks):
            publishers.append(ZmqEventPublisher(base, data_parallel_rank=r))
            subscribers.append(EventSubscriber(str(publishers[-1].endpoint)))
        time.sleep(0.3)
    servers = [_Rank(page_size, 16_384, publishers[r] if publishers else None) for r in range(ranks)]
    hasher = Sha256CborHasher(SEED)
    router = EventRouter(ranks, lambda tokens, salt: hasher.hash_tokens(tokens, page_size, salt))
    dp_router = DPRouter([s.tree for s in servers], "cache_aware")
    first, turns, out_rng = _demo_requests(workload)
    queue = collections.deque(first)
    prompt_tokens = cached = 0
    rank_of: list[int] = []
    routed_tokens = [0] * ranks  # the tree-reading router's load: prompt tokens given so far
    rr = 0
    while queue:
        rid, prompt = queue.popleft()
        if policy == "events":
            for r, (sub, srv) in enumerate(zip(subscribers, servers, strict=True)):
                assert srv.bridge is not None
                while sub.last_seq + 1 < srv.bridge.published_batches:  # wait for the network only
                    for _, batch in sub.receive(0.05):
                        router.apply(r, batch)
            rank = router.route(prompt)
        elif policy == "round_robin":
            rank, rr = rr, (rr + 1) % ranks
        else:
            rank = dp_router.route(prompt, [RankLoad(routed_tokens[r], rank_of.count(r)) for r in range(ranks)])
        rank_of.append(rank)
        routed_tokens[rank] += len(prompt)
        output = [out_rng.randrange(workload.vocab_size) for _ in range(workload.output_tokens)]
        prompt_tokens += len(prompt)
        cached += servers[rank].serve(prompt, output)
        if rid.startswith("c"):
            chat, turn = (int(x) for x in rid[1:].split("."))
            if turn + 1 < workload.turns:
                queue.append((f"c{chat}.{turn + 1}", prompt + output + turns[chat][turn + 1]))
    for p in publishers:
        p.close()
    for s in subscribers:
        s.close()
    return {
        "hit_rate": round(cached / prompt_tokens, 4),
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "requests_per_rank": [rank_of.count(r) for r in range(ranks)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    streams = wl.workloads(quick=args.quick)
    with tempfile.TemporaryDirectory(prefix="kvjax-events-") as tmp:
        cost = {
            name: {
                f"page{ps}": {h: bench_cost(stream, ps, h, repeats, tmp) for h in ("kvjax", "sha256_cbor")}
                for ps in (1, 16)
            }
            for name, stream in streams.items()
        }
        throughput = bench_throughput(streams["shared_prefix"], 16, tmp)
        demo = Workload()
        scaled = Workload(groups=6, chats=6)
        routing = {}
        for label, workload in (("demo", demo), ("demo_6_groups_6_chats", scaled)):
            routing[label] = {
                policy: bench_routing(workload, policy, 4, 16, tmp, f"{label}-{policy}")
                for policy in ("round_robin", "events", "cache_aware_tree")
            }
    print(
        json.dumps(
            {
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
                "cost": cost,
                "throughput": throughput,
                "routing": {"ranks": 4, "page_size": 16, **routing},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
