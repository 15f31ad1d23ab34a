"""SWAKVPool.set_kv_buffer of 256 tokens into a sliding layer (through the full->SWA mapping), bf16
pools of 1024 and 8192 pages on each side, jitted with donation.

In place means the time does not grow with the pool: the target is large/small <= 1.3 (as for
``kv_write.py``); the same write without donation is measured beside it. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, median_seconds  # noqa: E402
from kvjax.alloc import SWATokenToKVPoolAllocator  # noqa: E402
from kvjax.pools import MHAKVPool, SWAKVPool  # noqa: E402

TOKENS = 256
PAGE_SIZE = 16
KV_HEADS = 8
HEAD_DIM = 128


def _mha(num_pages: int) -> MHAKVPool:
    return MHAKVPool.create(
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        platform=jax.default_backend(),
    )


def make_writer(num_pages: int, *, donate: bool):
    """A zero-argument callable doing one blocking sliding-layer write of TOKENS tokens."""
    pool = SWAKVPool(full=_mha(num_pages), swa=_mha(num_pages), full_layer_ids=(1,), swa_layer_ids=(0,))
    alloc = SWATokenToKVPoolAllocator(num_pages * PAGE_SIZE, num_pages * PAGE_SIZE, PAGE_SIZE)
    rng = np.random.default_rng(0)
    alloc.alloc(num_pages // 2 * PAGE_SIZE)  # the live slots sit mid-pool
    loc = jnp.asarray(alloc.alloc(TOKENS))
    mapping = alloc.device_mapping()
    k = jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    step = jax.jit(
        lambda p, loc, k, m: p.set_kv_buffer(0, loc, k, k, full_to_swa=m), donate_argnums=0 if donate else ()
    )
    state = {"pool": pool}

    def run() -> None:
        state["pool"] = step(state["pool"], loc, k, mapping)
        state["pool"].swa.kv[0].block_until_ready()

    return run


def time_pair(small: int, large: int, *, donate: bool, rounds: int) -> dict[int, float]:
    """Median seconds per write for both sizes, in alternating rounds (load hits both alike)."""
    writers = {n: make_writer(n, donate=donate) for n in (small, large)}
    for run in writers.values():
        run()  # compile
    times: dict[int, list[float]] = {small: [], large: []}
    for _ in range(rounds):
        for n, run in writers.items():
            times[n].append(median_seconds(run, repeats=5, warmup=1))
    return {n: float(np.median(t)) for n, t in times.items()}


def main() -> None:
    small, large = 1024, 8192
    donated = time_pair(small, large, donate=True, rounds=15)
    copied = time_pair(small, large, donate=False, rounds=3)
    ratio = donated[large] / donated[small]
    print(
        json.dumps(
            {
                "benchmark": "swa_write",
                "tokens": TOKENS,
                "page_size": PAGE_SIZE,
                "pages_per_side": [small, large],
                "donated_us": {str(n): round(t * 1e6, 1) for n, t in donated.items()},
                "donated_ratio_large_over_small": round(ratio, 3),
                "target_ratio": 1.3,
                "meets_target": ratio <= 1.3,
                "not_donated_us": {str(n): round(t * 1e6, 1) for n, t in copied.items()},
                "not_donated_ratio_large_over_small": round(copied[large] / copied[small], 3),
                "machine": machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
