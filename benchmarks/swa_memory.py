"""How many concurrent requests fit with hybrid SWA memory against ``disable_hybrid_swa_memory``:
planned for Gemma-3-12B, then measured in the serving loop on a scaled-down model. Prints one JSON.

    python benchmarks/swa_memory.py [--quick]

* Planned: the ``gemma-3-12b`` preset (48 layers, 5 sliding : 1 full, window 1,024, 8 KV heads of
  256, bf16) with a 16 GiB KV budget, page 16, 32,768-token requests: ``requests_that_fit`` with
  hybrid SWA at ``swa_full_tokens_ratio`` 0.8 (SGLang's default), 0.2 and 0.05, and with it off.
* Measured: a random-weight Gemma 3 of the same layer pattern scaled down (6 layers, window 16,
  512-token requests: the same window / context ratio of 1/32), served by the scheduler with a KV
  budget where the plan without hybrid SWA fits 2 requests. 12 requests (448-token prompts, 64
  generated tokens) arrive at once; the peak number running together in decode is reported, with
  the plan's figure beside it. Decode-time window freeing keeps each running request at about one
  window of SWA slots, so the full pool decides how many run.
CPU figures; the ratio is the point.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine  # noqa: E402
from kvjax import CacheConfig, build_kv_cache  # noqa: E402
from kvjax.plan import plan_kv_cache  # noqa: E402
from kvjax.serve.model import init_params  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.spec import ModelSpec  # noqa: E402

GiB = 1 << 30
RATIOS = (0.8, 0.2, 0.05)


def planned() -> dict:
    spec = ModelSpec.preset("gemma-3-12b")
    out: dict = {}
    configs = {f"hybrid_ratio_{r}": dict(swa_full_tokens_ratio=r) for r in RATIOS}
    configs["hybrid_off"] = dict(disable_hybrid_swa_memory=True)
    for name, extra in configs.items():
        plan = plan_kv_cache(
            spec, CacheConfig(memory_budget_bytes=16 * GiB, context_length=32768, page_size=16, **extra)
        )
        out[name] = {
            "requests_that_fit_32k": plan.requests_that_fit(32768),
            "full_tokens_per_layer": plan.full_tokens_per_layer or plan.max_total_tokens,
            "swa_tokens_per_layer": plan.swa_tokens_per_layer,
        }
    return out


def tiny_spec() -> ModelSpec:
    """The shipped tiny Gemma 3 with six layers, five of them sliding (Gemma 3's 5:1 pattern)."""
    types = ["sliding_attention"] * 5 + ["full_attention"]
    return ModelSpec.preset("gemma3-tiny", num_hidden_layers=6, layer_types=types)


def measured(quick: bool) -> dict:
    spec = tiny_spec()
    params = init_params(spec)
    context, prompt_len, new = 512, 448, 64
    n_reqs = 6 if quick else 12
    # A budget where the full-size pools (no hybrid SWA) fit two 512-token requests.
    off = plan_kv_cache(
        spec,
        CacheConfig(
            max_total_tokens=2 * context + 16,
            context_length=context,
            page_size=16,
            disable_hybrid_swa_memory=True,
            platform="cpu",
        ),
    )
    budget = sum(p.nbytes for p in off.pools if p.memory == "device")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, prompt_len).tolist() for _ in range(n_reqs)]
    out: dict = {"kv_budget_bytes": budget, "requests": n_reqs, "request_tokens": context}
    configs = {f"hybrid_ratio_{r}": dict(swa_full_tokens_ratio=r) for r in (0.8, 0.05)}
    configs["hybrid_off"] = dict(disable_hybrid_swa_memory=True)
    for name, extra in configs.items():
        config = CacheConfig(
            memory_budget_bytes=budget,
            context_length=context,
            page_size=16,
            max_running_requests=16,
            chunked_prefill_size=64,
            **extra,
        )
        cache = build_kv_cache(spec, config)
        sched = Scheduler(spec, cache, params, max_batch_size=16, chunked_prefill_size=64)
        sched.submit([ServingReq(i, p, max_new_tokens=new) for i, p in enumerate(prompts)])
        peak = 0
        start = time.perf_counter()
        while not sched.idle:
            sched.step()
            peak = max(peak, len(sched.running))
        assert sched.leak_free()
        out[name] = {
            "planned_requests_that_fit": cache.plan.requests_that_fit(context),
            "measured_peak_running": peak,
            "retractions": sched.stats.retractions,
            "full_tokens_per_layer": cache.plan.full_tokens_per_layer or cache.plan.max_total_tokens,
            "swa_tokens_per_layer": cache.plan.swa_tokens_per_layer,
            "seconds": round(time.perf_counter() - start, 1),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 requests instead of 12")
    args = parser.parse_args(argv)
    result = {
        "benchmark": "swa_memory",
        "planned_gemma_3_12b_16GiB": planned(),
        "measured_scaled_down": measured(args.quick),
        "machine": machine(),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
