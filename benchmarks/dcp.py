"""Decode context parallelism: how many tokens fit when each request's KV is striped over DCP
ranks instead of replicated, and what the striped step costs. Prints one JSON object.

    python benchmarks/dcp.py [--tiny]

Sections:

DCP divides the TP group, as in SGLang (``--tp T --dcp D``: the same ``T`` chips, KV heads over
``T / D`` of them, tokens striped over ``D``, weights split over all ``T``).

* ``planned_v5e_8``: Llama-3-70B (8 KV heads) and DeepSeek-V3 (MLA: one latent, replicated over
  TP) planned for a v5e-8 (8 chips x 16 GiB, ``mem_fraction_static`` 0.9, pages of 16 rows per
  device) at TP 8 with DCP 1/2/4/8. ``pool_tokens`` is the allocator's (striped) pool,
  ``rows_per_device`` one device's share; ``ratio`` is the pool against DCP 1, and ``goal`` the
  stripe's full factor (DCP) where TP alone would replicate the KV (the latent, or KV heads fewer
  than the TP ranks), else 1 (the KV heads already split over the chips: DCP trades the head
  split for the token split at equal bytes). The weights are not subtracted here (neither model's
  weights fit a v5e-8; ``benchmarks/dcp_plan.py`` subtracts a given checkpoint size); they are
  split over the 8 chips at every DCP size, so they cost the same at every row.
* ``built_cpu``: what is built on the CPU mesh: the tiny preset (2 KV heads, 4 query heads) and
  the tiny DeepSeek (MLA) with the same per-device byte budget at TP 4 with DCP 1, 2 and 4: the
  allocator's tokens, one device's rows and pool bytes, and the ratio of tokens to DCP 1 (goal:
  the DCP factor times the KV heads a device holds at DCP 1 over those it holds here; TP 4 stores
  each of the 2 KV heads twice, which DCP 2 turns into twice the tokens, and DCP 4 too (each
  device then holds both heads of a quarter of the tokens); the latent is stored on every TP
  rank, so its goal is the DCP factor).
* ``step_cpu``: seconds per decode step of the tiny model served by the scheduler on 4 CPU
  devices, TP 4 alone against TP 4 with DCP 2 and DCP 4 (a CPU figure: the host devices share
  this machine's cores, so it shows the overhead of the striped program, its query gather and its
  merge, not a TPU speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

# The host platform is split into 8 devices before jax starts (a CPU mesh of 8).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, warm_decode_run  # noqa: E402
from kvjax import CacheConfig  # noqa: E402
from kvjax.chips import tpu_chip  # noqa: E402
from kvjax.plan import plan_kv_cache  # noqa: E402
from kvjax.spec import ModelSpec  # noqa: E402

CHIPS = 8
DCP_SIZES = (1, 2, 4, 8)
PLANNED = ("llama-3-70b", "deepseek-v3")
BUILT_LAYOUTS = ((1, 4), (2, 4), (4, 4))  # (DCP, TP) of the tiny presets (4 query heads: TP <= 4)
BUILT_MODELS = {
    "tiny": "2 KV heads (TP 4 stores each twice)",
    "deepseek-tiny": "MLA latent (replicated over TP)",
}


def planned_v5e_8() -> dict[str, Any]:
    """The plan of each model at TP 8 with DCP 1/2/4/8 on a v5e-8 (module docstring)."""
    hbm = tpu_chip("v5e").hbm_bytes
    out: dict[str, Any] = {"chip_hbm_bytes": hbm, "mem_fraction_static": 0.9, "page_size_per_device": 16}
    for model in PLANNED:
        spec = ModelSpec.preset(model)
        rows: dict[str, Any] = {}
        base = None
        for dcp in DCP_SIZES:
            tp = CHIPS
            config = CacheConfig(page_size=16, mem_fraction_static=0.9, tp_size=tp, dcp_size=dcp, platform="tpu")
            plan = plan_kv_cache(spec, config, device_memory_bytes=hbm)
            base = plan.max_total_tokens if base is None else base
            replicated = plan.is_mla or spec.num_kv_heads < CHIPS
            rows[f"dcp{dcp}_tp{tp}"] = {
                "pool_tokens": plan.max_total_tokens,
                "rows_per_device": plan.max_total_tokens // dcp,
                "kv_heads_per_device": plan.num_kv_heads_per_rank,
                "bytes_per_token_per_device": plan.bytes_per_token,
                "ratio": round(plan.max_total_tokens / base, 4),
                "goal": dcp if replicated else 1,
            }
        out[model] = {"kv": "mla latent" if spec.is_mla else f"{spec.num_kv_heads} KV heads", "by_dcp": rows}
    return out


def built_cpu(budget: int) -> dict[str, Any]:
    """The tiny presets built on the CPU mesh with ``budget`` bytes per device (module docstring)."""
    import jax

    from kvjax import build_kv_cache
    from kvjax.mesh_check import make_serving_mesh

    devices = jax.devices("cpu")
    out: dict[str, Any] = {"budget_bytes_per_device": budget}
    for model, kv in BUILT_MODELS.items():
        rows: dict[str, Any] = {}
        base: tuple[int, int] | None = None
        for dcp, tp in BUILT_LAYOUTS:
            config = CacheConfig(
                page_size=4,
                memory_budget_bytes=budget,
                max_running_requests=4,
                tp_size=tp,
                dcp_size=dcp,
                context_length=512,
            )
            mesh = make_serving_mesh(tp, dcp_size=dcp, devices=devices)
            cache = build_kv_cache(ModelSpec.preset(model), config, mesh=mesh)
            tokens = cache.allocator.available_size()
            heads = cache.plan.num_kv_heads_per_rank
            per_device = sum(
                leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(cache.pools) if leaf.ndim >= 2
            )
            base = (tokens, heads) if base is None else base
            rows[f"dcp{dcp}_tp{tp}"] = {
                "allocator_tokens": tokens,
                "rows_per_device": tokens // dcp,
                "kv_heads_per_device": heads,
                "device_pool_bytes": per_device,
                "ratio": round(tokens / base[0], 4),
                # The stripe's factor, less what a device pays for holding more heads than at DCP 1.
                "goal": dcp * base[1] / heads,
            }
        out[model] = {"kv": kv, "by_dcp": rows}
    return out


def step_cpu(tiny: bool) -> dict[str, Any]:
    """Seconds per decode step of the tiny model on 4 CPU devices, TP 4 against TP 4 with DCP 2 and 4."""
    import jax
    import numpy as np

    from kvjax import build_kv_cache
    from kvjax.mesh_check import make_serving_mesh
    from kvjax.serve.model import init_params
    from kvjax.serve.scheduler import Scheduler

    spec = ModelSpec.preset("tiny")
    params = init_params(spec)
    prompts = [list(np.random.default_rng(i).integers(1, 200, 48 if tiny else 96)) for i in range(4)]
    new = 8 if tiny else 32
    out: dict[str, Any] = {"note": "CPU figure: the host devices share this machine's cores; not a TPU speed-up"}
    for dcp in (1, 2, 4):
        config = CacheConfig(page_size=4, max_total_tokens=2048, max_running_requests=8, tp_size=4, dcp_size=dcp)
        mesh = make_serving_mesh(4, dcp_size=dcp, devices=jax.devices("cpu"))
        sched = Scheduler(spec, build_kv_cache(spec, config, mesh=mesh), params, max_batch_size=4)
        tokens, figures = warm_decode_run(sched, prompts, new)
        out[f"dcp{dcp}_tp4"] = {**figures, "devices": 4}
        out.setdefault("tokens", tokens)
        assert tokens == out["tokens"], "every layout generates the same tokens"
    out.pop("tokens")
    base = out["dcp1_tp4"]["decode_step_seconds"]
    for key in ("dcp2_tp4", "dcp4_tp4"):
        out[key]["ratio_to_tp4"] = round(out[key]["decode_step_seconds"] / base, 3)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="short prompts and few decode steps")
    args = parser.parse_args(argv)
    result = {
        "machine": machine(),
        "planned_v5e_8": planned_v5e_8(),
        "built_cpu": built_cpu(1 << 20),
        "step_cpu": step_cpu(args.tiny),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
