"""set_kv_buffer of 256 tokens into one-layer bf16 pools of 1024 and 8192 pages, jitted with donation.

In place means the time does not grow with the pool: the target is large/small <= 1.3. The same
write without donation (which must copy the pool) is measured beside it to show the difference.
Prints one JSON object.
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

TOKENS = 256
PAGE_SIZE = 16
KV_HEADS = 8
HEAD_DIM = 128


def make_writer(num_pages: int, *, donate: bool):
    """A zero-argument callable doing one blocking write of TOKENS tokens into a fresh pool."""
    pool = one_layer_bf16_pool(num_pages, page_size=PAGE_SIZE, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    rng = np.random.default_rng(0)
    pages = rng.choice(np.arange(1, num_pages + 1), size=TOKENS // PAGE_SIZE, replace=False)
    loc = jnp.asarray((pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).ravel().astype(np.int32))
    k = jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    step = jax.jit(lambda p, loc, k, v: p.set_kv_buffer(0, loc, k, v), donate_argnums=0 if donate else ())
    state = {"pool": pool}

    def run() -> None:
        state["pool"] = step(state["pool"], loc, k, v)
        state["pool"].kv[0].block_until_ready()

    return run


def main() -> None:
    small, large = 1024, 8192
    donated = alternating_medians(lambda n: make_writer(n, donate=True), (small, large), rounds=15)
    copied = alternating_medians(lambda n: make_writer(n, donate=False), (small, large), rounds=3)
    bytes_per_page = PAGE_SIZE * 2 * KV_HEADS * HEAD_DIM * 2
    print(
        json.dumps(
            {
                "benchmark": "kv_write",
                "tokens": TOKENS,
                "page_size": PAGE_SIZE,
                "pool_bytes": {str(n): (n + 1) * bytes_per_page for n in (small, large)},
                **in_place_figures(donated, copied),
                "machine": machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
