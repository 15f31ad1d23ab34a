"""Shared helpers for the benchmark scripts: timing and machine facts. Every script prints one JSON object."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
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
