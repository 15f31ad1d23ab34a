"""Prefill/decode disaggregation where a side is several processes (``jax.distributed``), from the
command line: ``python -m kvjax launch --processes 2 --cpu-devices-per-process 2 -- generate
--tp 4 --disaggregation-mode prefill|decode ...``.

A prefill side of two processes (tp 4, two devices each, pages of 4) serves a decode server of one
process (tp 2, pages of 8), and a prefill server of one process (tp 2) serves a decode side of
two processes (tp 4, pages of 8). The tiny model has 2 KV heads: a side of two processes holds
one head block on each, so a pull gathers units offered by two processes, or hands one process's
units to two (``kvjax.disaggregation.piece_units``; every pairing of layouts is checked without
processes in ``tests/disaggregation/test_piece_units.py``).
Every decode run prints the tokens a colocated ``generate --json`` prints, its own tree reuses
the shared prefix, and no request fails; SIGTERM to the launcher stops a prefill group cleanly
(every process exits 0, process 0's summary counts what was prefilled and offered).
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import time
from typing import Any

import pytest

from tests.mesh.multihost_group import child_env
from tests.mesh.subprocess_run import ROOT
from tests.mesh.test_pd_cli import ADDRESS_WAIT_S, _address, _kvjax

pytestmark = pytest.mark.mesh

SHARED = ",".join(str(t) for t in range(1, 13))  # 12 tokens, shared by the first two prompts
PROMPTS = ["--prompt-ids", SHARED, "--prompt-ids", f"{SHARED},13,14,15", "--prompt-ids", "40,41,42"]
FLAGS = ["--max-new-tokens", "4", "--ignore-eos", "--json"]
GROUP = ["launch", "--processes", "2", "--cpu-devices-per-process", "2", "--"]
DECODE_WAIT_S = 240  # both decode runs end within this (seconds)


def _start_prefill(argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen:
    """A prefill server (``argv`` after ``python -m kvjax``), started; `_address` waits for its address."""
    return subprocess.Popen(_kvjax(*argv), stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)


def _stop(process: subprocess.Popen, log: Any) -> str:
    """SIGTERM ``process``; its log, once it exited 0."""
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
        raise
    log.seek(0)
    text = log.read()
    assert code == 0, text[-3000:]
    return text


def _json_line(stdout: str) -> Any:
    """The JSON report in ``stdout`` (process 0's under a launch: its ``[0] `` prefix dropped)."""
    lines = [line.removeprefix("[0] ") for line in stdout.splitlines()]
    return json.loads(next(line for line in lines if line.startswith("{")))


def _start_decode(argv: list[str], address: str, env: dict[str, str]) -> subprocess.Popen:
    """A decode run (``argv`` after ``python -m kvjax``) over the prefill server at ``address``, started."""
    flags = ["--disaggregation-mode", "decode", "--disaggregation-prefill-addr", address]
    flags += ["--disaggregation-decode-enable-radix-cache"]
    return subprocess.Popen(
        _kvjax(*argv, *flags, *PROMPTS, *FLAGS),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _report(process: subprocess.Popen, deadline: float) -> Any:
    """The JSON report of a decode run, once it exited 0 (killed past ``deadline``)."""
    try:
        out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate(timeout=10)
        raise
    assert process.returncode == 0, err[-3000:]
    return _json_line(out)


@pytest.mark.timeout(900)
def test_sides_of_several_processes_give_the_colocated_tokens(tmp_path):
    env = child_env(devices=4, secret=secrets.token_hex(32))
    prefill = ["generate", "--model", "tiny", "--disaggregation-mode", "prefill"]
    prefill += ["--disaggregation-bootstrap-port", "0"]
    group_log = (tmp_path / "group-prefill.err").open("w+")
    single_log = (tmp_path / "single-prefill.err").open("w+")
    # the two prefill sides start side by side, the colocated reference runs while they start, and
    # the two decode runs (each over its own prefill side) run side by side: every wait bounded
    group = _start_prefill([*GROUP, *prefill, "--tp", "4", "--page-size", "4"], env, group_log)
    try:
        single = _start_prefill([*prefill, "--tp", "2", "--page-size", "4"], env, single_log)
        try:
            colocated = subprocess.run(
                _kvjax("generate", "--model", "tiny", "--page-size", "8", *PROMPTS, *FLAGS),
                capture_output=True,
                text=True,
                env=env,
                cwd=ROOT,
                timeout=120,
            )
            assert colocated.returncode == 0, colocated.stderr[-3000:]
            expected = json.loads(colocated.stdout)
            deadline = time.monotonic() + ADDRESS_WAIT_S
            group_address, single_address = _address(group, deadline), _address(single, deadline)
            decodes = {
                "one decode process <- a prefill group": _start_decode(
                    ["generate", "--model", "tiny", "--tp", "2", "--page-size", "8"], group_address, env
                ),
                "a decode group <- one prefill process": _start_decode(
                    [*GROUP, "generate", "--model", "tiny", "--tp", "4", "--page-size", "8"], single_address, env
                ),
            }
            deadline = time.monotonic() + DECODE_WAIT_S
            try:
                runs = {what: _report(process, deadline) for what, process in decodes.items()}
            finally:
                for process in decodes.values():
                    if process.poll() is None:
                        process.kill()
                        process.wait(10)
        finally:
            _stop(single, single_log)
    finally:
        log = _stop(group, group_log)
    for what, got in runs.items():
        assert got["outputs"] == expected["outputs"], (what, got, expected)
        pd = got["disaggregation"]
        assert pd["failed_requests"] == 0 and pd["prefill_servers"] == 1, (what, pd)
        # the decode side's own tree holds the shared page: the second prompt pulls the rest only
        assert pd["pulled_tokens"] + pd["reused_tokens"] == got["prompt_tokens"] == 30, (what, got)
        assert pd["reused_tokens"] == expected["cached_tokens"] == 8, (what, pd, expected)
    # one decode run was served by the prefill group: 3 prompts, 30 - 8 tokens offered
    summary = [line for line in log.splitlines() if "stopped (SIGTERM)" in line]
    assert len(summary) == 1 and summary[0].startswith("[0] python -m kvjax generate: prefill server"), log[-3000:]
    assert summary[0].endswith("3 prompts prefilled, 22 tokens offered"), summary
