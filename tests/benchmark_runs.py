"""Run a benchmark script's ``--tiny`` mode as the tests of its report do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_tiny(script: str) -> Any:
    """Run ``python SCRIPT --tiny`` (``script`` relative to the repository root) on 8 CPU devices,
    at most 360 s; assert it exits 0 and return the JSON report it prints."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, script, "--tiny"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=360
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)
