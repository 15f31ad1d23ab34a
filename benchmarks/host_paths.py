"""Host-path costs: the allocator's validated ``free``, ``cache_finished_req`` and the serving
step's pool-structure check (``KVCache.set_pools``), optionally next to another checkout.

    python benchmarks/host_paths.py [--baseline-path DIR] [--quick] [--rounds N]

``--baseline-path`` is the root of another kvjax checkout (the folder holding its ``kvjax``
package, e.g. the commit before a change). Each round runs every checkout once, interleaved, in
a fresh process of its own (this script with ``--worker``, importing ``kvjax`` from that root);
the best time per case over the rounds is kept for each, so load from other processes on a
shared machine hits both alike. Times are the calling thread's CPU time (``time.thread_time``):
on a loaded machine wall time also counts the time the process waits for a core. Prints one
JSON object: µs per call for each case, and with a baseline, ``before_us`` / ``after_us`` and
``speedup`` (before / after).

Cases (each timed call alone; the setup around it is not timed):
  * ``free_paged_76_pages``: a paged allocator (page 16, 2**20 slots) frees the 1,216 slots of
    76 pages it just handed out (the tree freeing an evicted node, a request its row);
  * ``free_paged_1_page``: the same for one page (a finished request's tail);
  * ``free_paged_76_pages_shuffled``: 76 pages whose slots come in a random order;
  * ``free_token_1216``: the page-size-1 allocator (2**20 slots) frees 1,216 slots;
  * ``cache_finished_req_page_16`` / ``_page_1``: a finished request (1,024-token shared system
    prompt of 8, a 128-token question, 64 output tokens; KV for all but the last) is cached
    and released, with a real allocator and request table: its duplicates and unaligned tail
    are freed, its lock released;
  * ``set_pools_llama_3_8b``: ``KVCache.set_pools`` of the pools a jitted step returned (32
    layers, 34 leaves), the check each serving step makes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# The worker: times every case on the kvjax found at sys.path[0].


def _best_us(
    setup: Callable[[], Any],
    call: Callable[[Any], Any],
    *,
    calls: int,
    samples: int,
    after: Callable[[Any], Any] | None = None,
) -> float:
    """Best over ``samples`` of the mean µs (thread CPU time) of ``call(setup())`` over ``calls``
    calls (only the call is timed; the garbage collector is off while timing). ``after(arg)``,
    when given, runs after each call, untimed (the case's cleanup)."""
    clock = time.thread_time
    best = float("inf")
    for _ in range(samples):
        total = 0.0
        gc.collect()
        gc.disable()
        try:
            for _ in range(calls):
                arg = setup()
                start = clock()
                call(arg)
                total += clock() - start
                if after is not None:
                    after(arg)
        finally:
            gc.enable()
        best = min(best, total / calls * 1e6)
    return round(best, 2)


def _free_cases(calls: int, samples: int) -> dict[str, float]:
    import numpy as np

    from kvjax.alloc import make_allocator

    out = {}
    rng = np.random.default_rng(0)
    for name, page_size, n, shuffle in (
        ("free_paged_76_pages", 16, 1216, False),
        ("free_paged_1_page", 16, 16, False),
        ("free_paged_76_pages_shuffled", 16, 1216, True),
        ("free_token_1216", 1, 1216, False),
    ):
        alloc = make_allocator(2**20, page_size)

        def setup(alloc: Any = alloc, n: int = n, shuffle: bool = shuffle) -> Any:
            ids = alloc.alloc(n)
            return rng.permutation(ids) if shuffle else ids

        out[name] = _best_us(setup, alloc.free, calls=calls, samples=samples)
    return out


def _finish_case(page_size: int, calls: int, samples: int) -> float:

    from kvjax.alloc import make_allocator
    from kvjax.radix import RadixCache
    from kvjax.req_pool import ReqToTokenPool
    from kvjax.request import Req

    rng = random.Random(page_size)
    systems = [[rng.randrange(32_000) for _ in range(1024)] for _ in range(8)]
    alloc = make_allocator(2**18, page_size)
    rows = ReqToTokenPool(4, 2048)
    tree = RadixCache(page_size=page_size, token_to_kv_pool_allocator=alloc, req_to_token_pool=rows)
    counter = [0]

    def setup() -> Any:
        counter[0] += 1
        prompt = systems[counter[0] % len(systems)] + [rng.randrange(32_000) for _ in range(128)]
        output = [rng.randrange(32_000) for _ in range(64)]
        got = rows.alloc(1)
        assert got is not None
        req = Req(f"r{counter[0]}", prompt, req_pool_idx=int(got[0]))
        m = tree.match_and_lock(req)
        rows.write(req.req_pool_idx, 0, m.indices)
        req.output_ids = output
        kv_len = len(prompt) + len(output) - 1  # the last output token has no KV yet
        last = int(rows.req_to_token[req.req_pool_idx, m.prefix_len - 1]) if m.prefix_len else -1
        if alloc.available_size() < 4096:
            tree.evict(8192)
        slots = alloc.alloc_extend([m.prefix_len], [kv_len], [last])
        assert slots is not None
        rows.write(req.req_pool_idx, m.prefix_len, slots)
        req.kv_committed_len = kv_len
        return req

    kept: list[Any] = []  # the timed requests stay alive: none is deallocated inside a timed call

    def release_row(req: Any) -> None:
        rows.free(req.req_pool_idx)
        kept.append(req)

    for _ in range(32):  # warm the tree: every system prompt cached
        req = setup()
        tree.cache_finished_req(req)
        release_row(req)
    return _best_us(setup, tree.cache_finished_req, calls=calls, samples=samples, after=release_row)


def _set_pools_case(calls: int, samples: int) -> float:
    import jax

    import kvjax

    spec = kvjax.ModelSpec.preset("llama-3-8b")
    cache = kvjax.build_kv_cache(spec, kvjax.CacheConfig(page_size=16, max_total_tokens=1024))
    step = jax.jit(lambda pools: pools)  # stands for the serving step: returns the pools it got
    pools = step(cache.pools)
    return _best_us(lambda: pools, cache.set_pools, calls=calls, samples=samples)


def run_worker(quick: bool) -> dict[str, Any]:
    import kvjax

    calls, samples = (40, 15) if quick else (40, 40)
    cases: dict[str, float] = {}
    cases.update(_free_cases(calls, samples))
    for ps in (16, 1):
        cases[f"cache_finished_req_page_{ps}"] = _finish_case(ps, calls // 2, samples)
    cases["set_pools_llama_3_8b"] = _set_pools_case(calls * 5, samples)
    return {"kvjax": os.path.dirname(os.path.dirname(os.path.abspath(kvjax.__file__))), "us": cases}


# ---------------------------------------------------------------------------------------------
# The driver.


def _spawn(root: str, quick: bool) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--root", root]
    if quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        raise SystemExit(f"worker for {root} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-path", help="root of another kvjax checkout, timed side by side")
    parser.add_argument("--quick", action="store_true", help="fewer calls per sample")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per checkout (best kept)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, args.root)
        print(json.dumps(run_worker(args.quick)))
        return
    roots = {"after": _ROOT}
    if args.baseline_path:
        roots = {"before": os.path.abspath(args.baseline_path), **roots}
    best: dict[str, dict[str, float]] = {k: {} for k in roots}
    for _ in range(args.rounds):
        for label, root in roots.items():
            got = _spawn(root, args.quick)["us"]
            for case, us in got.items():
                best[label][case] = min(us, best[label].get(case, float("inf")))
    cases: dict[str, Any] = {}
    for case, after in best["after"].items():
        entry: dict[str, Any] = {"after_us": after}
        if "before" in best:
            before = best["before"][case]
            entry = {"before_us": before, "after_us": after, "speedup": round(before / after, 2)}
        cases[case] = entry
    report = {
        "benchmark": "host_paths",
        "note": (
            "CPU time of the calling thread (µs per call), best over samples and rounds; "
            "CPU figures of this host, not TPU figures"
        ),
        "quick": args.quick,
        "rounds": args.rounds,
        "checkouts": roots,
        "cases": cases,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
