"""Suite-wide settings: a persistent XLA compilation cache shared by the test process and the
subprocesses it starts (``python -m kvjax ...``), so a step compiled once is not compiled again."""

from __future__ import annotations

import os
import tempfile

import jax

_CACHE_DIR = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kvjax-test-xla-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
