"""Host-tier benchmarks, one JSON object.

    python -m benchmarks.host_tier [--pages 64] [--layers 8]      # transfers
    python -m benchmarks.host_tier --serving [--pool 512] [--rounds 5]   # serving

Transfers: device -> host and host -> device throughput of the page engine (both staging paths;
on one CPU device, the engine's direct path) against a plain numpy copy of the same bytes, in the
same run (target: >= 0.5 of it). ``default_staging``: what ``staging="auto"`` picks here.

Serving (the demo's tiny model and workload): the hit-rate gain of the host tier on a device pool
smaller than the working set (``--pool`` tokens), and the serving step's time with transfers in
flight (host tier on, write-through backups every insert, a pool large enough that nothing is
evicted) against without (target: at most 5% slower). A warm-up run compiles every shape first;
then ``--rounds`` runs of each, interleaved, and the best of each is compared (the machine is
shared: a run that another process slowed down is not the serving loop's cost).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks._common import machine, median_seconds


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--serving", action="store_true", help="the serving figures instead of the transfers")
    ap.add_argument("--pool", type=int, default=512, help="device pool tokens for the hit-rate gain")
    ap.add_argument("--rounds", type=int, default=5, help="serving runs of each kind (best of them)")
    args = ap.parse_args(argv)
    if args.serving:
        out = serving(args.pool, args.rounds)
        print(json.dumps(out, indent=1))
        return out

    import jax

    from kvjax.device_updates import PendingDeviceUpdates
    from kvjax.pools import CachePools, MHAKVPool
    from kvjax.tiers import HostKVPool, TransferStatus
    from kvjax.transfers.transfer import PageTransferEngine, default_staging

    n = args.pages
    pool = MHAKVPool.create(
        num_pages=2 * n + 1,
        page_size=args.page_size,
        num_layers=args.layers,
        num_kv_heads=args.heads,
        head_dim=args.head_dim,
        dtype="bfloat16",
    )
    updates = PendingDeviceUpdates(CachePools(kv=pool))  # the owner's pools, applied to as a step would
    host = HostKVPool.for_device_layers(pool.kv, 2 * n * args.page_size)
    ps = args.page_size
    dev_slots = (np.arange(1, n + 1)[:, None] * ps + np.arange(ps)).ravel()
    host_slots = host.allocator.alloc(n * ps)
    nbytes = args.layers * n * ps * 2 * args.heads * args.head_dim * 2
    out: dict = {"bytes_per_transfer": nbytes, "machine": machine(), "config": vars(args)}
    out["default_staging"] = default_staging(jax.default_backend())

    src = np.random.default_rng(0).integers(0, 2**16, size=host.buffer_shape(n), dtype=np.uint16)
    dst = np.empty_like(src)
    memcpy = median_seconds(lambda: np.copyto(dst, src), repeats=args.repeats)
    out["numpy_copy_GBps"] = round(nbytes / memcpy / 1e9, 3)
    for staging in ("numpy", "pinned_host"):
        engine = PageTransferEngine(updates, host, staging=staging)
        out[f"{engine.staging}_path"] = "direct" if engine.direct else "staged"

        def backup(engine=engine):
            h = engine.start_backup(dev_slots, host_slots)
            assert engine.poll(h, wait=True) is TransferStatus.DONE

        def load(engine=engine):
            h = engine.start_load(host_slots, dev_slots)
            updates.apply(updates.owner_pools)  # the owner applies the recorded scatter
            assert engine.poll(h, wait=True) is TransferStatus.DONE

        d2h = median_seconds(backup, repeats=args.repeats)
        h2d = median_seconds(load, repeats=args.repeats)
        out[f"d2h_{engine.staging}_GBps"] = round(nbytes / d2h / 1e9, 3)
        out[f"h2d_{engine.staging}_GBps"] = round(nbytes / h2d / 1e9, 3)
        out[f"d2h_{engine.staging}_vs_numpy"] = round(memcpy / d2h, 3)
        out[f"h2d_{engine.staging}_vs_numpy"] = round(memcpy / h2d, 3)
    jax.block_until_ready(updates.owner_pools)
    print(json.dumps(out, indent=1))
    return out


def serving(pool: int, rounds: int = 5) -> dict:
    from kvjax.demo import serve
    from kvjax.serve.workload import Workload

    workload = Workload()
    out: dict = {"machine": machine(), "workload_requests": workload.num_requests, "pool_tokens": pool}
    serve(workload, disable_radix_cache=True)  # compiles every shape
    for host in (False, True):
        sched, _ = serve(workload, max_total_tokens=pool, enable_hierarchical_cache=host)
        key = "with_host_tier" if host else "without_host_tier"
        out[f"cached_tokens_{key}"] = sched.stats.cached_tokens
        out[f"hit_rate_{key}"] = round(sched.stats.hit_rate, 4)
    out["hit_rate_gain"] = round(out["hit_rate_with_host_tier"] - out["hit_rate_without_host_tier"], 4)
    serve(workload, enable_hierarchical_cache=True)  # compiles the transfers' shapes
    times: dict[bool, float] = {}
    book: dict[bool, float] = {}
    out["rounds"] = rounds
    for host in (False, True) * rounds:  # interleaved, best of each (the machine is shared)
        sched, _ = serve(workload, enable_hierarchical_cache=host)
        st = sched.stats
        steps = st.prefill_steps + st.decode_steps
        per_step = (st.step_seconds + st.pack_seconds + st.bookkeeping_seconds) / steps
        times[host] = min(times.get(host, float("inf")), per_step)
        book[host] = min(book.get(host, float("inf")), st.bookkeeping_seconds / steps)
        if host:
            out["host_tokens_backed_up"] = sched.cache.tree_cache.host.host_allocator.used_size()
    out["step_ms_without_transfers"] = round(times[False] * 1e3, 3)
    out["step_ms_with_transfers_in_flight"] = round(times[True] * 1e3, 3)
    out["step_time_ratio"] = round(times[True] / times[False], 4)
    out["bookkeeping_ms_per_step_without"] = round(book[False] * 1e3, 3)
    out["bookkeeping_ms_per_step_with"] = round(book[True] * 1e3, 3)
    return out


if __name__ == "__main__":
    main()
