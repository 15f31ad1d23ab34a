"""Lockstep DP serving with overlap scheduling on host devices, run in a subprocess.

``python -m tests.mesh.dp_overlap_checks`` (at least 2 host devices) serves a small demo
workload with one scheduler, then with ``LockstepDPScheduler`` over dp 2 with overlap on and off
(radix cache off: cold; on: warm), every rank's balance checked after every round
(``tests.mesh.dp_balance``); then the workload's requests again with a stop token each, found
one step late under overlap (a dropped speculative token). Prints the facts as JSON.
"""

from __future__ import annotations

import json

from kvjax.demo_config import MAX_BATCH
from kvjax.dp.lockstep import LockstepDPScheduler
from kvjax.serve.scheduler import ServingReq
from kvjax.serve.workload import run_workload
from tests.mesh.dp_balance import BalancedFront
from tests.serve.dp_serving import dp2_config, tiny_dp2_setup
from tests.workloads import SMALL_THREE_GROUPS as WORKLOAD


def main() -> dict:
    spec, params, expected, mesh = tiny_dp2_setup(WORKLOAD)
    result: dict = {}
    outputs = {}
    prompts: dict[str, list[int]] = {}

    def front(overlap: bool, radix_off: bool) -> LockstepDPScheduler:
        config = dp2_config(disable_radix_cache=radix_off)
        return LockstepDPScheduler.build_lockstep(spec, config, params, mesh, max_batch_size=MAX_BATCH, overlap=overlap)

    for overlap in (True, False):
        for label, radix_off in (("cold", True), ("warm", False)):
            key = f"{label}_{'overlap' if overlap else 'no_overlap'}"
            lockstep = front(overlap, radix_off)
            checked = BalancedFront(lockstep)
            outputs[key] = run_workload(checked, WORKLOAD)
            prompts.update((str(r.rid), list(r.origin_input_ids)) for r in lockstep.finished)
            result[key] = {
                "equal_single": outputs[key] == expected,
                "leak_free": [s.leak_free() for s in lockstep.schedulers],
                "overlap": [s.overlap for s in lockstep.schedulers],
                "rounds_checked": checked.rounds,
                "dp_steps": lockstep.dp_steps,
                "cached_tokens": lockstep.cached_tokens,
                "ranks_used": sorted(set(lockstep.rank_of.values())),
            }
    result["all_equal"] = all(o == expected for o in outputs.values())

    # Stop tokens: each request stops on its own token at a different position (its first
    # occurrence ends it); under overlap the stop is read one round late.
    names = sorted(expected)
    stops = {n: expected[n][(1 + i) % len(expected[n])] for i, n in enumerate(names)}
    want = {n: expected[n][: expected[n].index(stops[n]) + 1] for n in names}
    result["stops_shorten"] = sum(len(want[n]) < len(expected[n]) for n in names)
    for overlap in (True, False):
        lockstep = front(overlap, False)
        checked = BalancedFront(lockstep)
        reqs = [
            ServingReq(n, prompts[n], max_new_tokens=WORKLOAD.output_tokens, stop_token_ids=[stops[n]]) for n in names
        ]
        checked.run(reqs)
        key = f"stop_{'overlap' if overlap else 'no_overlap'}"
        result[key] = {
            "equal_expected": {str(r.rid): r.output_ids for r in reqs} == want,
            "leak_free": [s.leak_free() for s in lockstep.schedulers],
            "dropped_tokens": sum(s.stats.dropped_tokens for s in lockstep.schedulers),
            "generated_tokens": sum(s.stats.generated_tokens for s in lockstep.schedulers),
            "want_tokens": sum(map(len, want.values())),
            "rounds_checked": checked.rounds,
        }
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
