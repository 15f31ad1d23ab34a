"""Start a prefill server and a decode server as two processes on loopback (``pd_process``) and
read their reports; every wait is bounded."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.mesh.subprocess_run import ROOT


def pd_env(devices: int = 4, secret: str | None = None) -> dict[str, str]:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["KVJAX_CLUSTER_SECRET"] = secret or secrets.token_hex(32)
    return env


class PrefillProcess:
    """``pd_process prefill ...`` running; ``address`` once it listens (``wait=False``: once
    `wait_address` returned, so that several servers start side by side)."""

    def __init__(
        self, checkpoint: Path, env: dict[str, str], *args: str, timeout: float = 180, wait: bool = True
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.mesh.pd_process", "prefill", "--checkpoint", str(checkpoint), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.deadline = time.monotonic() + timeout
        self.address = ""
        if wait:
            self.wait_address()

    def wait_address(self) -> str:
        """The address the server printed once it listens (bounded by the start's ``timeout``)."""
        assert self.proc.stdout is not None
        line = ""
        while time.monotonic() < self.deadline and not line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
        if not line:
            self.proc.kill()
            raise AssertionError(
                f"the prefill server did not start:\n{self.proc.stderr.read()[-4000:] if self.proc.stderr else ''}"
            )
        self.address = json.loads(line)["address"]
        return self.address

    def stop(self, timeout: float = 60) -> dict[str, Any]:
        """Close its input (it finishes what is queued and reports); its report."""
        out, err = self.proc.communicate("", timeout=timeout)
        assert self.proc.returncode == 0, f"the prefill server exited with {self.proc.returncode}:\n{err[-4000:]}"
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def run_decode(
    checkpoint: Path,
    env: dict[str, str],
    rounds: Sequence[Sequence[dict[str, Any]]],
    tmp: Path,
    *args: str,
    timeout: float = 300,
) -> dict[str, Any]:
    """``pd_process decode`` over ``rounds`` of requests; its report."""
    requests = tmp / "requests.json"
    requests.write_text(json.dumps(rounds))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.mesh.pd_process",
            "decode",
            "--checkpoint",
            str(checkpoint),
            "--requests",
            str(requests),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, f"the decode server exited with {out.returncode}:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])
