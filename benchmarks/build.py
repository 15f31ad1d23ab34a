"""Build a >= 4 GiB MHA pool on CPU: wall time and peak RSS against the pool's bytes.

Target: peak RSS <= 1.1 x pool bytes + 400 MiB (the pool is created on the device directly, one
layer at a time, with no host staging copy). The build runs in a fresh child process so that its
peak RSS is its own. Prints one JSON object.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_BYTES = 4 * 2**30 + 2**28  # 4.25 GiB of KV for llama-3-8b
MiB = 2**20


def child() -> None:
    sys.path.insert(0, str(ROOT))
    import jax

    import kvjax

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    spec = kvjax.ModelSpec.preset("llama-3-8b")
    config = kvjax.CacheConfig(
        page_size=16, memory_budget_bytes=BUDGET_BYTES, context_length=8192, max_running_requests=256
    )
    start = time.perf_counter()
    cache = kvjax.build_kv_cache(spec, config)
    jax.block_until_ready(cache.pools)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pool_bytes = cache.pools.kv.nbytes()
    print(
        json.dumps(
            {
                "model": spec.name,
                "pool_bytes": pool_bytes,
                "pool_gib": round(pool_bytes / 2**30, 3),
                "layers": cache.pools.kv.num_layers,
                "layer_shape": list(cache.pools.kv.kv[0].shape),
                "storage_dtype": str(cache.pools.kv.store_dtype),
                "build_seconds": round(seconds, 3),
                "peak_rss_bytes": peak,
                "rss_before_build_bytes": before,
                "platform": cache.plan.platform,
            }
        )
    )


def main() -> None:
    out = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    limit = 1.1 * result["pool_bytes"] + 400 * MiB
    result.update(
        {
            "benchmark": "build",
            "peak_rss_over_pool": round(result["peak_rss_bytes"] / result["pool_bytes"], 3),
            "target_peak_rss_bytes": int(limit),
            "meets_target": result["peak_rss_bytes"] <= limit,
        }
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
