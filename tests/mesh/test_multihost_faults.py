"""Faults of a multi-process run end it within a bounded time with an error naming the process:
a killed process under the launcher, a process that dies or hangs between exchanges (no
launcher: the others' bounded wait names it), an unreachable coordinator. Loopback only.

Run as a program (``python -m tests.mesh.test_multihost_faults MODE``) it is one process of a
group that exchanges until process 1 dies (``die``) or stops answering (``hang``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvjax.cli import main
from kvjax.multihost.cluster_secret import CLUSTER_SECRET_ENV, ClusterSecret
from kvjax.serve.multihost.launcher import free_port
from tests.mesh.multihost_group import child_env, join, parse_group_args, run_group
from tests.mesh.subprocess_run import ROOT

TIMEOUT_S = 3.0  # the group's bound on every wait, in the die / hang programs
QUIT_AFTER = 3  # exchanges process 1 makes before it dies or hangs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_process_stops_the_launch_and_names_it():
    argv = [sys.executable, "-m", "kvjax", "launch", "--processes", "2", "--", "demo", "--tp", "2", "--json"]
    argv += ["--groups", "1", "--chats", "1", "--system-tokens", "16", "--output-tokens", "2"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: dict[int, int] = {}
    assert proc.stderr is not None
    while len(pids) < 2:
        line = proc.stderr.readline()
        assert line, "the launcher ended before starting its processes"
        if line.startswith("launch: process ") and "(pid " in line:
            pids[int(line.split()[2])] = int(line.split("(pid ")[1].split(",")[0])
    time.sleep(3)  # the processes are joining the group and compiling
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 15, "the launcher did not stop within the bound"
    assert proc.returncode != 0
    assert "launch: process 1 was killed by SIGKILL; the other processes were stopped" in err, err[-3000:]
    assert not _alive(pids[0]), "process 0 still runs"


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_dead_or_hung_process_is_named_by_the_others_within_the_bound(mode):
    results = run_group(["-m", "tests.mesh.test_multihost_faults", mode], devices=1, timeout=60, kill_on_failure=False)
    report = results[0].report
    assert report["lost"] == 1, report
    assert f"process 1 sent nothing for exchange {QUIT_AFTER}" in report["message"], report
    assert report["waited_s"] < TIMEOUT_S + 2, report


def test_an_unreachable_coordinator_is_one_clear_error(capsys, monkeypatch):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, ClusterSecret.generate().hex())
    port = free_port()
    argv = ["demo", "--num-processes", "2", "--process-id", "1", "--coordinator", f"127.0.0.1:{port}"]
    assert main([*argv, "--process-timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert f"the coordinator at 127.0.0.1:{port} did not answer within 1 s" in err, err
    assert err.count("\n") == 1, err


def test_launch_refuses_a_command_that_does_not_join_a_group(capsys):
    assert main(["launch", "--processes", "2", "--", "plan", "--model", "tiny"]) == 2
    assert "launch runs demo or generate across processes, got plan" in capsys.readouterr().err


def _exchange_until_lost(mode: str) -> None:
    args, _ = parse_group_args()
    group = join(args, timeout_s=TIMEOUT_S)
    from kvjax.multihost.errors import ProcessLostError

    for n in range(100):
        if group.process_id == 1 and n == QUIT_AFTER:
            if mode == "die":
                os._exit(17)
            time.sleep(TIMEOUT_S + 6)  # hung: alive (heartbeats go on) but silent
            os._exit(0)
        start = time.monotonic()
        try:
            group.channel.all_gather("tick", b"")
        except ProcessLostError as e:
            report = {"lost": e.process_id, "message": str(e), "waited_s": time.monotonic() - start}
            print(json.dumps(report), flush=True)
            os._exit(0)  # the group is broken: skip jax's shutdown barrier
    print(json.dumps({"lost": None, "message": "", "waited_s": 0}), flush=True)


if __name__ == "__main__":
    _exchange_until_lost(sys.argv[1])
