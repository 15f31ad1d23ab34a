"""Lockstep DP serving on host devices, run in a subprocess.

``python -m tests.mesh.dp_lockstep_checks`` (at least 2 host devices) serves a small demo
workload with one scheduler, then with ``LockstepDPScheduler`` over dp 2 (radix cache off: cold;
on: warm) and prints, as JSON, whether the outputs agree, the leak checks per rank, the cached
tokens and the device steps.
"""

from __future__ import annotations

import json

import jax

from kvjax import ModelSpec
from kvjax.demo import demo_cache
from kvjax.demo_config import MAX_BATCH, demo_config
from kvjax.dp.lockstep import LockstepDPScheduler
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.workload import Workload, run_workload

WORKLOAD = Workload(
    groups=3,
    prompts_per_group=3,
    system_tokens=64,
    question_tokens=8,
    chats=2,
    turns=2,
    turn_tokens=16,
    output_tokens=4,
)


def main() -> dict:
    spec = ModelSpec.preset("tiny")
    params = init_params(spec, seed=0)
    single = Scheduler(spec, demo_cache(max_total_tokens=2048, context_length=512), params, max_batch_size=MAX_BATCH)
    expected = run_workload(single, WORKLOAD)
    mesh = jax.make_mesh((2, 1), ("data", "tp"))
    result: dict = {}
    outputs = {}
    for label, radix_off in (("cold", True), ("warm", False)):
        config = demo_config(max_total_tokens=2048, context_length=512, disable_radix_cache=radix_off)
        config = config.replace(tp_size=2, dp_size=2, enable_dp_attention=True)
        front = LockstepDPScheduler.build_lockstep(spec, config, params, mesh, max_batch_size=MAX_BATCH, timeout_s=300)
        outputs[label] = run_workload(front, WORKLOAD)
        result[label] = {
            "equal_single": outputs[label] == expected,
            "leak_free": [s.leak_free() for s in front.schedulers],
            "cached_tokens": front.cached_tokens,
            "dp_steps": front.dp_steps,
            "rank_steps": [s.stats.prefill_steps + s.stats.decode_steps for s in front.schedulers],
            "ranks_used": sorted(set(front.rank_of.values())),
        }
    result["cold_equals_warm"] = outputs["cold"] == outputs["warm"]
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
