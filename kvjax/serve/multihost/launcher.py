"""`launch`: run one command as N local processes of one ``jax.distributed`` run.

Each process ``i`` runs ``python -m kvjax COMMAND ... --coordinator 127.0.0.1:PORT
--num-processes N --process-id i`` (a free loopback port; process 0 hosts the coordinator), with
``--local-cpu-devices K`` when asked. Their output lines are forwarded with a ``[i]`` prefix
(standard output to standard output, errors to errors). When a process ends with a non-zero
status the others are stopped (SIGTERM, then SIGKILL after ``grace_s``) and the launcher
returns that status; it never waits on a dead process's peers. On a TPU pod there is no
launcher: every host runs the command itself (``--distributed``).

Each launch gives its processes a cluster secret in their environment only
(``KVJAX_CLUSTER_SECRET``): never on a command line, never in a log line. The processes
authenticate each other with it (``kvjax.multihost.handshake``). It is the launcher's own
environment's secret when one is exported (a side of a disaggregated pair authenticates the other
side with it: both sides must hold the same), else a fresh one (``ClusterSecret.generate``) that
nothing outside the launch knows.

SIGTERM to the launcher is passed to every process, and the launcher returns once they all ended
(0 when each exited 0: a server that stops on SIGTERM, as a prefill server does, ends cleanly);
those still alive after ``grace_s`` are killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from kvjax.multihost.cluster_secret import CLUSTER_SECRET_ENV, ClusterSecret

__all__ = ["free_port", "launch"]


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forward(stream: IO[str], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(prefix + line)
            out.flush()


def _status_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def launch(
    command: Sequence[str],
    processes: int,
    *,
    cpu_devices: int | None = None,
    port: int | None = None,
    grace_s: float = 5.0,
    log: IO[str] | None = None,
) -> int:
    """Run ``python -m kvjax *command`` as ``processes`` processes (module docstring); returns 0
    when every process exits 0, else the first failure's status (1 for a killed process)."""
    log = log or sys.stderr
    address = f"127.0.0.1:{port or free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not env.get(CLUSTER_SECRET_ENV):
        env[CLUSTER_SECRET_ENV] = ClusterSecret.generate().hex()  # this launch's processes only
    lock = threading.Lock()
    procs: list[subprocess.Popen[str]] = []
    threads: list[threading.Thread] = []
    for i in range(processes):
        argv = [sys.executable, "-m", "kvjax", *command, "--coordinator", address]
        argv += ["--num-processes", str(processes), "--process-id", str(i)]
        if cpu_devices is not None:
            argv += ["--local-cpu-devices", str(cpu_devices)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        with lock:
            print(f"launch: process {i} of {processes} started (pid {proc.pid}, coordinator {address})", file=log)
            log.flush()
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_forward, args=(stream, out, f"[{i}] ", lock), daemon=True)
            t.start()
            threads.append(t)
    failed: tuple[int, int] | None = None
    terminated: list[float] = []  # when SIGTERM came (then passed to every process)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(time.monotonic()))
    passed = False
    try:
        while True:
            codes = [p.poll() for p in procs]  # every process, every time (poll reaps)
            failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or all(c == 0 for c in codes):
                break
            if terminated and not passed:
                passed = True
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            if terminated and time.monotonic() - terminated[0] > grace_s:
                _stop(procs, 0.0)
            time.sleep(0.05)
    except KeyboardInterrupt:
        failed = (-1, 130)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if failed is not None:
        _stop(procs, grace_s)
    for t in threads:
        t.join(timeout=grace_s)
    if failed is None:
        return 0
    who, code = failed
    with lock:
        if who >= 0:
            print(f"launch: process {who} {_status_text(code)}; the other processes were stopped", file=log)
        else:
            print("launch: interrupted; every process was stopped", file=log)
    return code if code > 0 else 1


def _stop(procs: Sequence[subprocess.Popen[str]], grace_s: float) -> None:
    """SIGTERM every live process, SIGKILL those still alive after ``grace_s`` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
