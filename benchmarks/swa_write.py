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

from benchmarks._common import alternating_medians, in_place_figures, machine, one_layer_bf16_pool  # noqa: E402
from benchmarks.kv_write import HEAD_DIM, KV_HEADS, PAGE_SIZE, TOKENS  # noqa: E402  (the same write)
from kvjax.alloc import SWATokenToKVPoolAllocator  # noqa: E402
from kvjax.pools import SWAKVPool  # noqa: E402


def make_writer(num_pages: int, *, donate: bool):
    """A zero-argument callable doing one blocking sliding-layer write of TOKENS tokens."""
    side = {"page_size": PAGE_SIZE, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    full, swa = one_layer_bf16_pool(num_pages, **side), one_layer_bf16_pool(num_pages, **side)
    pool = SWAKVPool(full=full, swa=swa, full_layer_ids=(1,), swa_layer_ids=(0,))
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


def main() -> None:
    small, large = 1024, 8192
    donated = alternating_medians(lambda n: make_writer(n, donate=True), (small, large), rounds=15)
    copied = alternating_medians(lambda n: make_writer(n, donate=False), (small, large), rounds=3)
    print(
        json.dumps(
            {
                "benchmark": "swa_write",
                "tokens": TOKENS,
                "page_size": PAGE_SIZE,
                "pages_per_side": [small, large],
                **in_place_figures(donated, copied),
                "machine": machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
