"""Pipeline parallelism: each stage's pool bytes against the one-stage pool, and the decode step over
stages on the CPU mesh. Prints one JSON object.

    python benchmarks/pp.py [--tiny]

Sections:

* ``planned``: Llama-3-8B (32 layers) planned for TPU at PP 1/2/4/8 (TP 1): ``fixed_tokens``, a
  pool of 65,536 tokens: each stage's device bytes and their ratio to the one-stage pool (goal
  ``1/pp``: a stage holds ``32/pp`` layers' K and V); ``fixed_budget``, 8 GiB of KV per device:
  the tokens every stage holds and their ratio to PP 1 (goal ``pp``: the same bytes per device
  over fewer layers).
* ``built_cpu``: the tiny preset stretched to 4 layers, built on the CPU mesh at PP 1/2/4 with a
  pool of 256 tokens: each stage's pool bytes as built (summed over the arrays on the stage's
  devices), the plan's figure for the stage, and the ratio to the one-stage build (goal ``1/pp``).
* ``step_cpu``: seconds per decode step of that model served by the scheduler on the CPU mesh,
  PP 2 and PP 4 (one and two micro-batches) against TP alone on as many devices (TP 2, TP 4;
  ``--tiny``: PP 2 and TP 2 only, few tokens), every layout asserted to generate the same tokens.
  A CPU figure: the host devices share this machine's cores, so it shows what the
  stage dispatch and the transfers between stages cost, not an accelerator's overlap.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from kvjax.plan import plan_kv_cache  # noqa: E402
from kvjax.spec import ModelSpec  # noqa: E402

PLANNED_MODEL = "llama-3-8b"
PLANNED_PP = (1, 2, 4, 8)
PLANNED_TOKENS = 65536
PLANNED_BUDGET = 8 << 30
BUILT_PP = (1, 2, 4)
BUILT_TOKENS = 256


def four_layer_tiny() -> ModelSpec:
    """The tiny preset (2 KV heads, 4 query heads) with 4 layers, so that 4 stages each hold one."""
    tiny = ModelSpec.preset("tiny")
    return dataclasses.replace(tiny, name="tiny-4-layers", num_hidden_layers=4, layer_kinds=tiny.layer_kinds * 2)


def planned() -> dict[str, Any]:
    """Llama-3-8B's stages planned at a fixed pool and at a fixed per-device budget (module docstring)."""
    spec = ModelSpec.preset(PLANNED_MODEL)
    fixed_tokens: dict[str, Any] = {}
    fixed_budget: dict[str, Any] = {}
    base_bytes = base_tokens = 0
    for pp in PLANNED_PP:
        stage_bytes, tokens = [], 0
        for rank in range(pp):
            plan = plan_kv_cache(
                spec, CacheConfig(max_total_tokens=PLANNED_TOKENS, pp_size=pp, pp_rank=rank, platform="tpu")
            )
            stage_bytes.append(plan.device_bytes)
            budget = CacheConfig(memory_budget_bytes=PLANNED_BUDGET, pp_size=pp, pp_rank=rank, platform="tpu")
            tokens = plan_kv_cache(spec, budget).max_total_tokens  # the same on every stage
        base_bytes = base_bytes or stage_bytes[0]
        base_tokens = base_tokens or tokens
        fixed_tokens[f"pp{pp}"] = {
            "stage_device_bytes": stage_bytes,
            "ratio_to_one_stage": [round(b / base_bytes, 4) for b in stage_bytes],
            "goal": round(1 / pp, 4),
        }
        fixed_budget[f"pp{pp}"] = {"pool_tokens": tokens, "ratio_to_pp1": round(tokens / base_tokens, 4), "goal": pp}
    return {
        "model": PLANNED_MODEL,
        "layers": spec.num_hidden_layers,
        "fixed_tokens": {"pool_tokens": PLANNED_TOKENS, "by_pp": fixed_tokens},
        "fixed_budget": {"kv_bytes_per_device": PLANNED_BUDGET, "by_pp": fixed_budget},
    }


def _config(pp: int, tp: int = 1) -> CacheConfig:
    return CacheConfig(
        page_size=4, max_total_tokens=BUILT_TOKENS, max_running_requests=8, context_length=256, pp_size=pp, tp_size=tp
    )


def built_cpu() -> dict[str, Any]:
    """Each stage's pool bytes built on the CPU mesh against the one-stage build (module docstring)."""
    import jax

    from kvjax.serve.pipeline_cache import build_pipeline_cache, pipeline_meshes

    spec = four_layer_tiny()
    out: dict[str, Any] = {"model": spec.name, "pool_tokens": BUILT_TOKENS}
    base = 0
    for pp in BUILT_PP:
        if pp == 1:
            from kvjax import build_kv_cache

            cache = build_kv_cache(spec, _config(1), mesh=pipeline_meshes(1, 1)[0])
            built, planned_bytes = [sum(a.nbytes for a in jax.tree.leaves(cache.pools))], [cache.plan.device_bytes]
        else:
            pipe = build_pipeline_cache(spec, _config(pp))
            built = [pipe.device_bytes(s) for s in range(pp)]
            planned_bytes = [plan.device_bytes for plan in pipe.plans]
        base = base or built[0]
        out[f"pp{pp}"] = {
            "stage_device_bytes": built,
            "planned_stage_device_bytes": planned_bytes,
            "ratio_to_one_stage": [round(b / base, 4) for b in built],
            "goal": round(1 / pp, 4),
        }
    return out


def step_cpu(tiny: bool) -> dict[str, Any]:
    """Seconds per decode step on the CPU mesh: PP 2 / PP 4 (1 and 2 micro-batches) against TP alone."""
    import jax
    import numpy as np

    from kvjax import build_kv_cache
    from kvjax.serve.model import init_params
    from kvjax.serve.pipeline_cache import build_pipeline_cache
    from kvjax.serve.pipeline_stepping import pipeline_scheduler
    from kvjax.serve.scheduler import Scheduler
    from kvjax.serve.tp_mesh import tp_mesh

    spec = four_layer_tiny()
    params = init_params(spec)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(1, 200, 24 if tiny else 96)] for i in range(4)]
    new = 6 if tiny else 32
    stages = (2,) if tiny else (2, 4)
    layouts: list[tuple[str, int, int, int]] = [(f"tp{pp}", 1, pp, 1) for pp in stages]
    layouts += [(f"pp{pp}_micro{m}", pp, 1, m) for pp in stages for m in (1, 2)]
    out: dict[str, Any] = {
        "model": spec.name,
        "note": "CPU figure: the host devices share this machine's cores; it shows the cost of the stage dispatch "
        "and transfers, not an accelerator's overlap",
    }
    reference = None
    for name, pp, tp, micro in layouts:
        sched: Scheduler
        if pp == 1:
            sched = Scheduler(spec, build_kv_cache(spec, _config(1, tp), mesh=tp_mesh(tp)), params, max_batch_size=4)
        else:
            pipe = build_pipeline_cache(spec, _config(pp), devices=jax.devices("cpu"))
            sched = pipeline_scheduler(spec, pipe, params, micro_batches=micro, max_batch_size=4)
        outputs, figures = warm_decode_run(sched, prompts, new)
        reference = reference or outputs
        assert outputs == reference, f"{name} generates other tokens"
        out[name] = {"devices": pp * tp, **figures}
    for pp in stages:
        base = out[f"tp{pp}"]["decode_step_seconds"]
        for m in (1, 2):
            row = out[f"pp{pp}_micro{m}"]
            row[f"ratio_to_tp{pp}"] = round(row["decode_step_seconds"] / base, 3)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="short prompts and few decode steps")
    args = parser.parse_args(argv)
    result = {"machine": machine(), "planned": planned(), "built_cpu": built_cpu(), "step_cpu": step_cpu(args.tiny)}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
