"""Shared helpers for the benchmark scripts: timing and machine facts. Every script prints one JSON object."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def median_seconds(fn: Callable[[], Any], *, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in seconds (``fn`` must block until its work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import jax

    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def one_layer_bf16_pool(num_pages: int, *, page_size: int, kv_heads: int, head_dim: int) -> Any:
    """A one-layer bf16 ``MHAKVPool`` of ``num_pages`` pages on the default backend (the pool the
    KV-write benchmarks write into)."""
    import jax

    from kvjax.pools import MHAKVPool

    return MHAKVPool.create(
        num_pages=num_pages,
        page_size=page_size,
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype="bfloat16",
        platform=jax.default_backend(),
    )


def alternating_medians(
    make_run: Callable[[int], Callable[[], Any]], sizes: Sequence[int], *, rounds: int
) -> dict[int, float]:
    """Median seconds per call of ``make_run(size)()`` for each size. Each run is called once
    first (compilation), then the sizes take turns for ``rounds`` rounds (a median of 5 calls
    each), so that load from other processes hits every size alike."""
    runs = {size: make_run(size) for size in sizes}
    for run in runs.values():
        run()
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(rounds):
        for size, run in runs.items():
            times[size].append(median_seconds(run, repeats=5, warmup=1))
    return {size: statistics.median(t) for size, t in times.items()}


def in_place_figures(donated: dict[int, float], copied: dict[int, float], *, target: float = 1.3) -> dict[str, Any]:
    """The figures of an in-place write timed on a small and a large pool (seconds per call by
    pool size, with the pool donated and not): microseconds, the large/small ratios, and whether
    the donated ratio meets ``target`` (in place: the time does not grow with the pool)."""
    small, large = min(donated), max(donated)
    ratio = donated[large] / donated[small]
    return {
        "donated_us": {str(n): round(t * 1e6, 1) for n, t in donated.items()},
        "donated_ratio_large_over_small": round(ratio, 3),
        "target_ratio": target,
        "meets_target": ratio <= target,
        "not_donated_us": {str(n): round(t * 1e6, 1) for n, t in copied.items()},
        "not_donated_ratio_large_over_small": round(copied[large] / copied[small], 3),
    }


def warm_decode_run(sched: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[list[list[int]], dict]:
    """Serve ``prompts`` twice through ``sched`` (the first run compiles; the tree is reset after
    each, so the second run is as cold as the first) and return the second run's output ids and
    its figures: ``decode_step_seconds`` (mean per decode step) and ``warm_run_seconds``."""
    from kvjax.serve.scheduler import ServingReq

    outputs: list[list[int]] = []
    wall = start_steps = start_seconds = 0.0
    for _ in range(2):
        start_steps, start_seconds = sched.stats.decode_steps, sched.stats.decode_step_seconds
        start = time.perf_counter()
        reqs = [ServingReq(f"r{i}", p, max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)]
        sched.run(reqs)
        wall = time.perf_counter() - start
        sched.cache.tree_cache.reset()
        outputs = [r.output_ids for r in reqs]
    steps = sched.stats.decode_steps - start_steps
    figures = {
        "decode_step_seconds": round((sched.stats.decode_step_seconds - start_seconds) / max(steps, 1), 5),
        "warm_run_seconds": round(wall, 3),
    }
    return outputs, figures
