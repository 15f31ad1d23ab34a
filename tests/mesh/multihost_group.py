"""Run a check program as the processes of one ``jax.distributed`` group on loopback, every wait
bounded, and read each process's JSON report.

``run_group(["-m", "tests.mesh.test_multihost_x", "mode"], processes=2, devices=4)`` starts the
program once per process with ``--coordinator 127.0.0.1:PORT --process-id I --num-processes N
--devices D`` appended (a free port), on the CPU platform; `join` is what the program calls to
join the group from those flags. When one process fails the others are killed; past ``timeout``
every process is killed and the test fails naming the processes still running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvjax.multihost.cluster_secret import CLUSTER_SECRET_ENV, ClusterSecret
from kvjax.serve.multihost.launcher import free_port
from tests.mesh.subprocess_run import ROOT


@dataclass
class ProcessResult:
    """One process's exit status, output and error text, and the JSON of its last output line."""

    process_id: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def report(self) -> Any:
        return json.loads(self.stdout.strip().splitlines()[-1])


def child_env(devices: int | None = None, secret: str | None = None) -> dict[str, str]:
    """The environment of a group's process: CPU platform, ``devices`` host devices, the repository
    importable, and the group's cluster secret (``secret``, hex; None leaves it unset: the
    launcher draws its own)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop(CLUSTER_SECRET_ENV, None)
    if secret is not None:
        env[CLUSTER_SECRET_ENV] = secret
    env.pop("XLA_FLAGS", None)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_group(
    python_args: Sequence[str],
    *,
    processes: int = 2,
    devices: int = 4,
    timeout: float = 120,
    kill_on_failure: bool = True,
) -> list[ProcessResult]:
    """Start the group (module docstring) and wait for every process, at most ``timeout`` s."""
    with contextlib.ExitStack() as stack:
        return _run_group(
            stack, python_args, processes=processes, devices=devices, timeout=timeout, kill_on_failure=kill_on_failure
        )


def _run_group(
    stack: contextlib.ExitStack,
    python_args: Sequence[str],
    *,
    processes: int,
    devices: int,
    timeout: float,
    kill_on_failure: bool,
) -> list[ProcessResult]:
    port = free_port()
    env = child_env(secret=ClusterSecret.generate().hex())  # one secret for the group's processes
    procs = []
    # Output goes to files, never pipes: a pipe nobody reads until the end fills and blocks its writer.
    files = [(stack.enter_context(_temp()), stack.enter_context(_temp())) for _ in range(processes)]
    start = time.monotonic()
    for i in range(processes):
        argv = [sys.executable, *python_args, "--coordinator", f"127.0.0.1:{port}"]
        argv += ["--process-id", str(i), "--num-processes", str(processes), "--devices", str(devices)]
        out, err = files[i]
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err, text=True))
    ended: dict[int, float] = {}
    while len(ended) < processes:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - start
        if kill_on_failure and any(procs[i].returncode != 0 for i in ended):
            break
        if time.monotonic() - start > timeout:
            running = [i for i in range(processes) if i not in ended]
            for p in procs:
                p.kill()
                p.wait()
            tails = "\n".join(f"--- process {i}:\n{_read(err)[-3000:]}" for i, (_, err) in enumerate(files))
            raise AssertionError(f"processes {running} still ran after {timeout} s\n{tails}")
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return [
        ProcessResult(i, p.returncode, _read(out), _read(err), ended.get(i, time.monotonic() - start))
        for i, (p, (out, err)) in enumerate(zip(procs, files, strict=True))
    ]


def _temp() -> Any:
    return tempfile.TemporaryFile("w+")


def _read(file: Any) -> str:
    file.seek(0)
    text: str = file.read()
    return text


def assert_all_ok(results: Sequence[ProcessResult]) -> list[Any]:
    """Every process exited 0; their reports, in process order."""
    for r in results:
        assert r.returncode == 0, f"process {r.process_id} exited with {r.returncode}:\n{r.stderr[-4000:]}"
    return [r.report for r in results]


def parse_group_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The flags `run_group` appends, and the program's own arguments before them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    return parser.parse_known_args(argv)


def join(args: argparse.Namespace, *, timeout_s: float = 30.0, check_agreement: bool = True) -> Any:
    """Join the group the flags describe (``kvjax.multihost.process_group.initialize``)."""
    from kvjax.multihost.process_group import ProcessFlags, initialize

    return initialize(
        ProcessFlags(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            cpu_devices=args.devices,
            timeout_s=timeout_s,
            check_agreement=check_agreement,
            join_timeout_s=60.0,
        )
    )


def join_and_load(directory: str) -> tuple[Any, Any]:
    """In a group's program: join the group from the flags ``run_group`` appends, then load the
    checkpoint saved in ``directory``; returns ``(group, LoadedModel)``."""
    args, _ = parse_group_args()
    group = join(args)
    from kvjax.serve.checkpoint import load_checkpoint

    return group, load_checkpoint(directory)


def request_records(finished: Sequence[Any]) -> dict[str, dict[str, list]]:
    """The JSON of a process's finished requests by name: each one's prompt, output and logits
    (``finished_requests`` reads them back)."""
    return {
        str(r.rid): {
            "prompt": [int(t) for t in r.origin_input_ids],
            "output": list(r.output_ids),
            "logits": [np.asarray(row).tolist() for row in r.logits],
        }
        for r in finished
    }


def finished_requests(report: dict, max_new: int) -> dict[str, Any]:
    """The finished requests of one process's report (``request_records``), with their tokens and
    logits, by name; asserts they are the parity rounds' six."""
    from kvjax.serve.serving_req import ServingReq

    done = {}
    for rid, item in report["requests"].items():
        req = ServingReq(rid, item["prompt"], max_new_tokens=max_new)
        req.output_ids.extend(item["output"])
        req.logits = [np.asarray(row, np.float32) for row in item["logits"]]
        done[rid] = req
    assert sorted(done) == ["a", "b", "c", "chat1", "chat2", "d"]
    return done
