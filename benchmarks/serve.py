"""Warm against cold on the demo workload, and what the radix tree costs when it cannot help.

Runs the demo workload through the serving loop (tiny model, default device) with:
  * the radix cache disabled (cold: ChunkCache),
  * the radix cache on but forced to miss (the tree's code path runs, nothing is reused),
  * the radix cache on (warm).
Reports prefill tokens computed, generated tokens per second, and the ratio of mean step time
forced-miss / disabled (target <= 1.05: the tree costs almost nothing when it cannot help).
Runs are interleaved and repeated; medians are reported. A first run compiles every step shape.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine  # noqa: E402
from kvjax.demo import serve  # noqa: E402
from kvjax.serve.workload import Workload  # noqa: E402

MODES = {
    "disabled": dict(disable_radix_cache=True),
    "forced_miss": dict(force_miss=True),
    "warm": dict(),
}


def run_once(workload: Workload, settings: dict) -> dict:
    start = time.perf_counter()
    sched, outputs = serve(workload, **settings)
    seconds = time.perf_counter() - start
    st = sched.stats
    steps = st.prefill_steps + st.decode_steps
    return {
        "seconds": seconds,
        "steps": steps,
        "step_ms": 1e3 * seconds / steps,
        "prefill_tokens_computed": st.prefill_tokens_computed,
        "cached_tokens": st.cached_tokens,
        "generated_tokens": st.generated_tokens,
        "tokens_per_second": st.generated_tokens / seconds,
        "leak_free": sched.leak_free(),
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    args = parser.parse_args()
    workload = Workload(groups=2, prompts_per_group=3, chats=2, turns=2) if args.quick else Workload()
    base = dict(page_size=16, max_total_tokens=16384, chunked_prefill_size=512)
    run_once(workload, {**base, **MODES["disabled"]})  # compile every step shape
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode, extra in MODES.items():
            runs[mode].append(run_once(workload, {**base, **extra}))
    med = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    outputs = {m: runs[m][0]["outputs"] for m in MODES}
    report = {
        "benchmark": "serve",
        "workload": {"requests": workload.num_requests, **{k: v for k, v in vars(workload).items()}},
        "repeats": args.repeats,
        **{
            mode: {
                "prefill_tokens_computed": runs[mode][0]["prefill_tokens_computed"],
                "cached_tokens": runs[mode][0]["cached_tokens"],
                "generated_tokens": runs[mode][0]["generated_tokens"],
                "steps": runs[mode][0]["steps"],
                "median_seconds": round(med(mode, "seconds"), 3),
                "median_step_ms": round(med(mode, "step_ms"), 3),
                "tokens_per_second": round(med(mode, "tokens_per_second"), 1),
                "leak_free": all(r["leak_free"] for r in runs[mode]),
            }
            for mode in MODES
        },
        "prefill_saved_fraction": round(
            1 - runs["warm"][0]["prefill_tokens_computed"] / runs["disabled"][0]["prefill_tokens_computed"], 4
        ),
        "forced_miss_over_disabled_step_time": round(med("forced_miss", "step_ms") / med("disabled", "step_ms"), 4),
        "target_forced_miss_over_disabled": 1.05,
        "warm_over_cold_tokens_per_second": round(
            med("warm", "tokens_per_second") / med("disabled", "tokens_per_second"), 3
        ),
        "outputs_identical": outputs["warm"] == outputs["disabled"] == outputs["forced_miss"],
        "machine": machine(),
    }
    report["meets_target"] = report["forced_miss_over_disabled_step_time"] <= 1.05
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
