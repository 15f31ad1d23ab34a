"""MLA figures in one JSON object: bytes per token of the latent pool against an MHA pool of the same
model (planned), the latent write's time on a small and a large pool (in place), MLA attention on
CPU (the jnp reference, the default CPU path, against the Pallas kernel under the HLO interpreter),
and the paper TPU roofline of a DeepSeek-V3 decode step (``benchmarks.mla_roofline``).

* bytes/token: DeepSeek-V3 (61 layers, 128 heads, qk 192 / v 128, kv_lora_rank 512 + rope 64) on
  TPU, from the layouts the planner uses (``MLALayout``, and ``MHALayout`` for the same model as if
  it cached K and V per head: padded to 256 lanes as kvjax's MHA layout pads K and V to one head
  dim), per rank at tp 1 and tp 8 (the MHA heads split, the latent replicated), with SGLang's
  unpadded formulas (``sglang-semantics`` §6) beside them.
* write: ``set_mla_kv_buffer`` of 256 tokens into one-layer bf16 latent pools (DeepSeek-V3 row, 576
  on CPU) of 1024 and 16384 pages, jitted with donation, medians over alternating rounds; in place
  means large/small stays near 1 (target <= 1.3), while a 16x larger pool copied would be ~16x.
* attention: a mixed batch (decode + chunks) at DeepSeek-V2-Lite-like small dims.

Usage: ``python -m benchmarks.mla [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, median_seconds  # noqa: E402
from benchmarks.mla_roofline import layer_roofline  # noqa: E402
from kvjax.layout.mha import MHALayout  # noqa: E402
from kvjax.layout.mla import MLALayout  # noqa: E402
from kvjax.pools import MLAKVPool  # noqa: E402
from pallas_kernels.mla_ragged_paged_attention import (  # noqa: E402
    mla_ragged_paged_attention,
    mla_ragged_paged_attention_reference,
)

LAYERS, HEADS, QK_HEAD, V_HEAD, RANK, ROPE = 61, 128, 192, 128, 512, 64


def bytes_per_token() -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for tp in (1, 8):
        for dtype in ("bfloat16", "fp8_e4m3"):
            mla = MLALayout.for_platform(
                kv_lora_rank=RANK, qk_rope_head_dim=ROPE, page_size=64, dtype=dtype, platform="tpu"
            )
            mha = MHALayout.for_platform(
                num_kv_heads=HEADS // tp,
                head_dim=QK_HEAD,
                v_head_dim=V_HEAD,
                page_size=64,
                dtype=dtype,
                platform="tpu",
            )
            itemsize = mla.itemsize
            mla_bytes = LAYERS * mla.bytes_per_token_per_layer
            mha_bytes = LAYERS * mha.bytes_per_token_per_layer
            rows.append(
                {
                    "tp": tp,
                    "kv_cache_dtype": dtype,
                    "mla_bytes_per_token": mla_bytes,
                    "mha_bytes_per_token": mha_bytes,
                    "mha_over_mla": round(mha_bytes / mla_bytes, 1),
                    "sglang_mla_bytes_per_token": LAYERS * (RANK + ROPE) * itemsize,
                    "sglang_mha_bytes_per_token": LAYERS * (HEADS // tp) * (QK_HEAD + V_HEAD) * itemsize,
                }
            )
    return {"model": "deepseek-v3 (61 layers) on TPU, per rank", "rows": rows}


def _writer(num_pages: int, tokens: int) -> Any:
    pool = MLAKVPool.create(
        num_pages=num_pages, page_size=16, num_layers=1, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, dtype="bfloat16"
    )
    rng = np.random.default_rng(0)
    pages = rng.choice(np.arange(1, num_pages + 1), size=tokens // 16, replace=False)
    loc = jnp.asarray((pages[:, None] * 16 + np.arange(16)).ravel().astype(np.int32))
    nope = jnp.asarray(rng.standard_normal((tokens, RANK)), jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((tokens, ROPE)), jnp.bfloat16)
    step = jax.jit(lambda p, loc, a, b: p.set_mla_kv_buffer(0, loc, a, b), donate_argnums=0)
    state = {"pool": pool}

    def run() -> None:
        state["pool"] = step(state["pool"], loc, nope, rope)
        state["pool"].kv[0].block_until_ready()

    return run


def write_ratio(rounds: int) -> dict[str, Any]:
    small, large, tokens = 1024, 16384, 256
    writers = {n: _writer(n, tokens) for n in (small, large)}
    for run in writers.values():
        run()
    times: dict[int, list[float]] = {small: [], large: []}
    for _ in range(rounds):
        for n, run in writers.items():
            times[n].append(median_seconds(run, repeats=5, warmup=1))
    med = {n: float(np.median(t)) for n, t in times.items()}
    row_bytes = (RANK + ROPE) * 2
    return {
        "tokens": tokens,
        "pool_bytes": {str(n): (n + 1) * 16 * row_bytes for n in (small, large)},
        "donated_us": {str(n): round(t * 1e6, 1) for n, t in med.items()},
        "ratio_large_over_small": round(med[large] / med[small], 3),
        "target_ratio": 1.3,
        "meets_target": med[large] / med[small] <= 1.3,
    }


def attention_on_cpu(repeats: int) -> dict[str, Any]:
    heads, rank, rope, padded, page = 16, 128, 32, 160, 16
    q_lens, kv_lens = (1, 1, 1, 1, 64, 32), (300, 120, 511, 64, 256, 32)
    max_seqs, pages_per_seq = len(q_lens), 32
    rng = np.random.default_rng(0)
    kv = np.zeros((max_seqs * pages_per_seq + 1, page, padded), np.float32)
    kv[..., : rank + rope] = rng.standard_normal((kv.shape[0], page, rank + rope))
    table = np.arange(1, max_seqs * pages_per_seq + 1, dtype=np.int32).reshape(max_seqs, pages_per_seq)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(cu[-1])
    args = (
        jnp.asarray(rng.standard_normal((total, heads, rank)), jnp.float32),
        jnp.asarray(rng.standard_normal((total, heads, rope)), jnp.float32),
        jnp.asarray(kv),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.asarray([max_seqs], jnp.int32),
    )
    scale = (64 + rope) ** -0.5
    reference = jax.jit(functools.partial(mla_ragged_paged_attention_reference, sm_scale=scale))
    kernel = jax.jit(functools.partial(mla_ragged_paged_attention, sm_scale=scale, interpret=True))
    want = reference(*args)
    got = kernel(*args)
    timings = {}
    for name, fn in (("reference_ms", reference), ("kernel_hlo_interpreter_ms", kernel)):
        timings[name] = round(median_seconds(lambda fn=fn: fn(*args).block_until_ready(), repeats=repeats) * 1e3, 2)
    return {
        "batch": {"q_lens": q_lens, "kv_lens": kv_lens, "heads": heads, "kv_lora_rank": rank, "rope": rope},
        **timings,
        "max_abs_difference": float(jnp.max(jnp.abs(got - want))),
        "note": "on CPU the default path is the reference; the interpreted kernel is a test path",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    roofline = [
        layer_roofline(chip, seqs=64, context=4096, tp=tp, itemsize=itemsize)
        for chip in ("v5e", "v6e")
        for tp in (1, 8)
        for itemsize in (2, 1)
    ]
    result = {
        "benchmark": "mla",
        "bytes_per_token": bytes_per_token(),
        "latent_write_in_place": write_ratio(rounds=3 if args.quick else 9),
        "attention_cpu": attention_on_cpu(repeats=3 if args.quick else 10),
        "tpu_roofline_deepseek_v3_decode_64x4096": roofline,
        "machine": machine(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
