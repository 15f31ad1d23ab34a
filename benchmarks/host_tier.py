"""Host-tier page transfers: device -> host and host -> device throughput of the page engine
(both staging paths) against a plain numpy copy of the same bytes, in the same run.

    python -m benchmarks.host_tier [--pages 64] [--layers 8]

Prints one JSON object: GB/s per path and the ratio to the numpy copy (target >= 0.5).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks._common import machine, median_seconds


class _Holder:
    def __init__(self, pools):
        self.pools = pools

    def set_pools(self, pools):
        self.pools = pools


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)

    import jax

    from kvjax.pools import CachePools, MHAKVPool
    from kvjax.tiers import HostKVPool, TransferStatus
    from kvjax.tiers.transfer import PageTransferEngine

    n = args.pages
    pool = MHAKVPool.create(
        num_pages=2 * n + 1,
        page_size=args.page_size,
        num_layers=args.layers,
        num_kv_heads=args.heads,
        head_dim=args.head_dim,
        dtype="bfloat16",
    )
    holder = _Holder(CachePools(kv=pool))
    host = HostKVPool.for_device_layers(pool.kv, 2 * n * args.page_size)
    ps = args.page_size
    dev_slots = (np.arange(1, n + 1)[:, None] * ps + np.arange(ps)).ravel()
    host_slots = host.allocator.alloc(n * ps)
    nbytes = args.layers * n * ps * 2 * args.heads * args.head_dim * 2
    out: dict = {"bytes_per_transfer": nbytes, "machine": machine(), "config": vars(args)}

    src = np.random.default_rng(0).integers(0, 2**16, size=host.buffer_shape(n), dtype=np.uint16)
    dst = np.empty_like(src)
    memcpy = median_seconds(lambda: np.copyto(dst, src), repeats=args.repeats)
    out["numpy_copy_GBps"] = round(nbytes / memcpy / 1e9, 3)
    for staging in ("numpy", "pinned_host"):
        engine = PageTransferEngine(holder, host, staging=staging)

        def backup(engine=engine):
            h = engine.start_backup(dev_slots, host_slots)
            assert engine.poll(h, wait=True) is TransferStatus.DONE

        def load(engine=engine):
            h = engine.start_load(host_slots, dev_slots)
            assert engine.poll(h, wait=True) is TransferStatus.DONE

        d2h = median_seconds(backup, repeats=args.repeats)
        h2d = median_seconds(load, repeats=args.repeats)
        out[f"d2h_{engine.staging}_GBps"] = round(nbytes / d2h / 1e9, 3)
        out[f"h2d_{engine.staging}_GBps"] = round(nbytes / h2d / 1e9, 3)
        out[f"d2h_{engine.staging}_vs_numpy"] = round(memcpy / d2h, 3)
        out[f"h2d_{engine.staging}_vs_numpy"] = round(memcpy / h2d, 3)
    jax.block_until_ready(holder.pools)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
