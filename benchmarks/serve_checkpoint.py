"""Serving a checkpoint directory: warm against cold, and what kvjax's host bookkeeping costs per
decode step next to the jitted step.

A tiny checkpoint (the ``tiny`` preset's seed-0 weights written as ``config.json`` +
``model.safetensors``) is loaded with ``load_checkpoint``, then:

* **warm vs cold**: the demo workload (shared system prompts, multi-turn chats) served with the
  radix cache disabled (cold) and enabled (warm), after one run that compiles every step shape;
  generated tokens per second of each, median of ``--repeats`` interleaved runs.
* **bookkeeping per decode step** at batch 16 and 64: that many requests (a shared 64-token
  prefix plus 16 tokens of their own) decode ``--decode-tokens`` tokens together. Per decode
  step, the scheduler's host time is split into bookkeeping (evict, ``alloc_decode``,
  request-table writes, caching and freeing finished requests), batch packing (page table and
  device inputs) and the jitted step (until its tokens are on the host); ``finish_us_per_step``
  is the part of bookkeeping spent finishing the requests (the tree insert of prompt + output,
  once per request, spread over the decode steps). Target: bookkeeping at most 10% of the step.
  Each batch runs ``--repeats`` times after a compiling run; medians are reported.

Prints one JSON object. CPU figures are not TPU figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks._common import machine  # noqa: E402
from kvjax import CacheConfig, ModelSpec, build_kv_cache  # noqa: E402
from kvjax.demo import serve  # noqa: E402
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint, save_checkpoint  # noqa: E402
from kvjax.serve.model import init_params  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.serve.workload import Workload  # noqa: E402

TARGET_BOOKKEEPING_OVER_STEP = 0.10


def warm_vs_cold(model: LoadedModel, workload: Workload, repeats: int) -> dict:
    settings: dict[str, Any] = dict(page_size=16, max_total_tokens=16384, chunked_prefill_size=512)
    serve(workload, model=model, disable_radix_cache=True, **settings)  # compile every step shape
    serve(workload, model=model, **settings)  # and the warm run's (prefix hits give other shapes)
    rates: dict[str, list[float]] = {"cold": [], "warm": []}
    outputs: dict[str, dict] = {}
    for _ in range(repeats):
        for mode, extra in (("cold", dict(disable_radix_cache=True)), ("warm", {})):
            start = time.perf_counter()
            sched, out = serve(workload, model=model, **settings, **extra)
            rates[mode].append(sched.stats.generated_tokens / (time.perf_counter() - start))
            outputs[mode] = out
    cold, warm = statistics.median(rates["cold"]), statistics.median(rates["warm"])
    return {
        "cold_tokens_per_second": round(cold, 1),
        "warm_tokens_per_second": round(warm, 1),
        "warm_over_cold": round(warm / cold, 3),
        "outputs_identical": outputs["cold"] == outputs["warm"],
    }


def decode_bookkeeping(model: LoadedModel, batch: int, decode_tokens: int, repeats: int) -> dict:
    rng = np.random.default_rng(batch)
    shared = rng.integers(0, model.config.vocab_size, 64).tolist()
    prompts = [shared + rng.integers(0, model.config.vocab_size, 16).tolist() for _ in range(batch)]
    config = CacheConfig(
        page_size=16,
        max_total_tokens=batch * (96 + decode_tokens) + 1024,
        max_running_requests=batch,
        context_length=256,
        chunked_prefill_size=batch * 80,
    )
    runs = []
    for _ in range(repeats + 1):  # the first run compiles
        cache = build_kv_cache(model.spec, config)
        sched = Scheduler(model.config, cache, model.params, max_batch_size=batch, chunked_prefill_size=batch * 80)
        sched.run([ServingReq(i, p, max_new_tokens=decode_tokens) for i, p in enumerate(prompts)])
        assert sched.leak_free()
        st = sched.stats
        steps = st.decode_steps
        runs.append(
            {
                "batch": batch,
                "decode_steps": steps,
                "bookkeeping_us_per_step": round(1e6 * st.decode_bookkeeping_seconds / steps, 1),
                "pack_us_per_step": round(1e6 * st.decode_pack_seconds / steps, 1),
                "step_us_per_step": round(1e6 * st.decode_step_seconds / steps, 1),
                "finish_us_per_step": round(1e6 * st.decode_finish_seconds / steps, 1),
                "bookkeeping_over_step": round(st.decode_bookkeeping_seconds / st.decode_step_seconds, 4),
                "bookkeeping_without_finishing_over_step": round(
                    (st.decode_bookkeeping_seconds - st.decode_finish_seconds) / st.decode_step_seconds, 4
                ),
                "bookkeeping_and_pack_over_step": round(
                    (st.decode_bookkeeping_seconds + st.decode_pack_seconds) / st.decode_step_seconds, 4
                ),
            }
        )
    runs = runs[1:]
    result: dict = {"batch": batch, "decode_steps": runs[0]["decode_steps"]}
    for key in runs[0]:
        if key not in result:
            result[key] = statistics.median(r[key] for r in runs)
    result["meets_target"] = result["bookkeeping_over_step"] <= TARGET_BOOKKEEPING_OVER_STEP
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a smaller demo workload")
    args = parser.parse_args()
    workload = Workload(groups=2, prompts_per_group=3, chats=2, turns=2) if args.quick else Workload()
    spec = ModelSpec.preset("tiny")
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(directory, spec, init_params(spec))
        model = load_checkpoint(directory)
    report = {
        "benchmark": "serve_checkpoint",
        "model": "tiny checkpoint (config.json + model.safetensors, float32)",
        "workload_requests": workload.num_requests,
        "repeats": args.repeats,
        "warm_vs_cold": warm_vs_cold(model, workload, args.repeats),
        "decode_bookkeeping": [decode_bookkeeping(model, b, args.decode_tokens, args.repeats) for b in (16, 64)],
        "target_bookkeeping_over_step": TARGET_BOOKKEEPING_OVER_STEP,
        "machine": machine(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
