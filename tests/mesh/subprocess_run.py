"""Run a check program in a fresh Python process with host CPU devices, and read its JSON report.

Multi-device tests need several devices, and XLA splits the host platform into devices only when jax
starts (``XLA_FLAGS=--xla_force_host_platform_device_count=N``); a pytest process may have started
jax already. So each check runs in a subprocess from the repository root, on the CPU platform,
and prints one JSON object as its last line of output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_with_devices(python_args: Sequence[str], *, devices: int = 8, timeout: float = 600) -> Any:
    """``python *python_args`` (e.g. ``["-m", "tests.mesh.dp_step_checks", "2"]`` or ``["-c",
    SCRIPT]``) run from the repository root with ``devices`` host CPU devices; the JSON value of
    the last line it prints.

    Raises:
        AssertionError: the program exited with a non-zero status (the message ends with its
            last 4000 characters of standard error).
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds (it is killed).
    """
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, *python_args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, f"the check exited with status {out.returncode}:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])
