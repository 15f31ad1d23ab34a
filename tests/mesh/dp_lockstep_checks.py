"""Lockstep DP serving on host devices, run in a subprocess.

``python -m tests.mesh.dp_lockstep_checks`` (at least 2 host devices) serves a small demo
workload with one scheduler, then with ``LockstepDPScheduler`` over dp 2 (radix cache off: cold;
on: warm) and prints, as JSON, whether the outputs agree, the leak checks per rank, the cached
tokens and the device steps.
"""

from __future__ import annotations

import json

from kvjax.demo_config import MAX_BATCH
from kvjax.dp.lockstep import LockstepDPScheduler
from kvjax.serve.workload import run_workload
from tests.serve.dp_serving import dp2_config, tiny_dp2_setup
from tests.workloads import SMALL_THREE_GROUPS as WORKLOAD


def main() -> dict:
    spec, params, expected, mesh = tiny_dp2_setup(WORKLOAD)
    result: dict = {}
    outputs = {}
    for label, radix_off in (("cold", True), ("warm", False)):
        config = dp2_config(disable_radix_cache=radix_off)
        front = LockstepDPScheduler.build_lockstep(spec, config, params, mesh, max_batch_size=MAX_BATCH)
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
