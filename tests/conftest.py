"""Suite-wide settings: a persistent XLA compilation cache shared by the test process and the
subprocesses it starts (``python -m kvjax ...``), so a step compiled once is not compiled again."""

from __future__ import annotations

import os
import tempfile

import jax

_CACHE_DIR = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kvjax-test-xla-cache")
)
# Every program is kept, however quick its compile: the tiny models' steps each compile in well under
# a second, and a process that loads them all from the cache (a CLI subprocess, a notebook's kernel,
# the next run) starts serving sooner than one that compiles them again.
_MIN_COMPILE_SECS = float(os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"))
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_SECS)
