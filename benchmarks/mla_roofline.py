"""TPU roofline on paper for MLA attention in a DeepSeek-V3 decode step (no TPU needed; prints JSON).

Per layer and chip, the absorbed MLA kernel (``pallas_kernels.mla_ragged_paged_attention``) reads
every visible latent row once (``row_padded`` lanes: 576 -> 640 on TPU) for all of the chip's heads
and does two matmuls per key: logits over the padded row and the update over ``kv_lora_rank``::

    bytes = seqs * context * row_padded * itemsize            (queries/outputs add < 1%)
    flops = 2 * seqs * heads_per_chip * context * (row_padded + kv_lora_rank)

Under attention tensor parallelism the heads split over the chips but the latent is replicated, so
every chip reads the whole latent: tp only divides the flops. The time bound of a layer is
``max(bytes / HBM bandwidth, flops / peak)``; a step is ``num_hidden_layers`` of them. fp8 pools
halve the bytes; the kernel widens fp8 to bf16, so compute runs at the bf16 peak (v5e has no fp8
MXU path). Chip figures: Google Cloud TPU documentation (HBM bandwidth, bf16 peak per chip).

Usage: ``python -m benchmarks.mla_roofline [--seqs 64] [--context 4096 32768]``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

#: (HBM bytes/s, bf16 FLOP/s) per chip.
CHIPS = {"v5e": (819e9, 197e12), "v6e": (1640e9, 918e12)}

# DeepSeek-V3 attention (kvjax/presets/deepseek-v3.json).
LAYERS, HEADS, RANK, ROPE = 61, 128, 512, 64
ROW_PADDED = 640


def layer_roofline(
    chip: str, *, seqs: int, context: int, tp: int, itemsize: int, row: int = ROW_PADDED
) -> dict[str, Any]:
    """The paper roofline of one MLA attention layer on one chip."""
    bandwidth, peak = CHIPS[chip]
    heads = HEADS // tp
    kv_bytes = seqs * context * row * itemsize
    flops = 2 * seqs * heads * context * (row + RANK)
    memory_s, compute_s = kv_bytes / bandwidth, flops / peak
    return {
        "chip": chip,
        "tp": tp,
        "heads_per_chip": heads,
        "kv_itemsize": itemsize,
        "seqs": seqs,
        "context": context,
        "kv_bytes_per_layer": kv_bytes,
        "flops_per_layer": flops,
        "arithmetic_intensity_flops_per_byte": round(flops / kv_bytes, 1),
        "ridge_flops_per_byte": round(peak / bandwidth, 1),
        "bound": "memory" if memory_s >= compute_s else "compute",
        "layer_us": round(max(memory_s, compute_s) * 1e6, 2),
        "step_attention_ms": round(LAYERS * max(memory_s, compute_s) * 1e3, 3),
        "tokens_per_s_attention_only": round(seqs / (LAYERS * max(memory_s, compute_s)), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64, help="decode batch (one new token per sequence)")
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768], help="keys per sequence")
    args = parser.parse_args()
    rows = [
        layer_roofline(chip, seqs=args.seqs, context=context, tp=tp, itemsize=itemsize)
        for chip in CHIPS
        for context in args.context
        for tp in (1, 8)
        for itemsize in (2, 1)
    ]
    print(
        json.dumps(
            {
                "benchmark": "mla_roofline",
                "model": "deepseek-v3 attention (128 heads, kv_lora_rank 512, qk_rope_head_dim 64, 61 layers)",
                "row_padded": ROW_PADDED,
                "chips": {
                    name: {"hbm_bytes_per_s": bw, "bf16_flops_per_s": peak} for name, (bw, peak) in CHIPS.items()
                },
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
