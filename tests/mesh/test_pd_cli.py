"""Prefill/decode disaggregation from the command line, as two processes on loopback:
``generate --disaggregation-mode prefill`` (tp 2, pages of 4) prints its bootstrap address, and
``generate --disaggregation-mode decode --disaggregation-prefill-addr ADDR --json`` (tp 1, pages
of 8) prints the tokens a colocated ``generate --json`` prints for the same prompts, with the decode
server's counters. SIGTERM stops the prefill server (exit status 0, its one-line summary); a decode
server whose prefill server is gone is one ``error:`` line."""

from __future__ import annotations

import json
import secrets
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.mesh.multihost_group import child_env
from tests.mesh.subprocess_run import ROOT

pytestmark = pytest.mark.mesh

SHARED = ",".join(str(t) for t in range(1, 13))  # 12 tokens, shared by the first two prompts
PROMPTS = ["--prompt-ids", SHARED, "--prompt-ids", f"{SHARED},13,14,15", "--prompt-ids", "40,41,42"]
FLAGS = ["--max-new-tokens", "4", "--ignore-eos", "--json"]
ADDRESS_WAIT_S = 120  # a launched group joins before it listens


def _kvjax(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvjax", *argv]


def _address(process: subprocess.Popen, deadline: float) -> str:
    """The address of the prefill server's ``prefill server listening on HOST:PORT`` line (bounded
    wait; a launched group's process 0 prints it behind its ``[0] `` prefix, after other lines)."""
    assert process.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if "prefill server listening on " in line:
                return line.split()[-1]
            assert line, f"the prefill server exited with status {process.wait(10)}"
        assert process.poll() is None, f"the prefill server exited with status {process.returncode}"
    raise AssertionError(f"the prefill server printed no address within {ADDRESS_WAIT_S} s")


@pytest.mark.timeout(300)
def test_generate_decode_over_a_prefill_process_gives_the_colocated_tokens(tmp_path):
    env = child_env(devices=4, secret=secrets.token_hex(32))
    prefill_log = (tmp_path / "prefill.err").open("w+")
    prefill = subprocess.Popen(
        _kvjax(
            *["generate", "--model", "tiny", "--disaggregation-mode", "prefill"], "--disaggregation-bootstrap-port", "0"
        )
        + ["--tp", "2", "--page-size", "4"],
        stdout=subprocess.PIPE,
        stderr=prefill_log,
        text=True,
        env=env,
        cwd=ROOT,
    )
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
        address = _address(prefill, time.monotonic() + ADDRESS_WAIT_S)
        decode_argv = [
            "--disaggregation-mode",
            "decode",
            "--disaggregation-prefill-addr",
            address,
            "--disaggregation-decode-enable-radix-cache",  # its own tree: the shared page is not pulled
        ]
        decode = subprocess.run(
            _kvjax("generate", "--model", "tiny", "--page-size", "8", *decode_argv, *PROMPTS, *FLAGS),
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )
        assert decode.returncode == 0, decode.stderr[-3000:]
        got = json.loads(decode.stdout)
        assert got["outputs"] == expected["outputs"], (got, expected)
        assert [len(o) for o in got["outputs"]] == [4, 4, 4]
        pd = got["disaggregation"]
        assert pd["failed_requests"] == 0 and pd["prefill_servers"] == 1, pd
        assert pd["pulled_tokens"] + pd["reused_tokens"] == got["prompt_tokens"] == 30, got
        assert pd["reused_tokens"] == got["cached_tokens"] == expected["cached_tokens"], (got, expected)
    finally:
        prefill.send_signal(signal.SIGTERM)
        try:
            code = prefill.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prefill.kill()
            prefill.wait(10)
            raise
    prefill_log.seek(0)
    log = prefill_log.read()
    assert code == 0, log[-3000:]
    summary = [line for line in log.splitlines() if "stopped (SIGTERM)" in line]
    offered = 30 - 8  # the prompts' tokens less the 8 the decode side reused
    expected_summary = f"prefill server {address} stopped (SIGTERM): 3 prompts prefilled, {offered} tokens offered"
    assert summary == [f"python -m kvjax generate: {expected_summary}"], log[-3000:]

    gone = subprocess.run(
        _kvjax("generate", "--model", "tiny", *decode_argv, *PROMPTS, *FLAGS),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert gone.returncode == 2 and gone.stdout == "", gone
    lines = gone.stderr.strip().splitlines()
    assert lines[-1].startswith("python -m kvjax generate: error: --disaggregation-prefill-addr"), gone.stderr[-2000:]
    assert address in lines[-1] and "cannot connect" in lines[-1], lines[-1]


@pytest.mark.timeout(300)
def test_demo_decode_over_a_demo_prefill_process_serves_the_demo_workload(tmp_path):
    """The demo's own workload (its built-in model and chats) through a decode server: its warm run
    served disaggregated gives the cold run's tokens (served here, colocated: ``ok``), its own tree
    reuses the chats' earlier turns, and no request fails."""
    env = child_env(devices=4, secret=secrets.token_hex(32))
    prefill_log = (tmp_path / "prefill.err").open("w+")
    prefill = subprocess.Popen(
        _kvjax("demo", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0", "--tp", "2"),
        stdout=subprocess.PIPE,
        stderr=prefill_log,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        address = _address(prefill, time.monotonic() + ADDRESS_WAIT_S)
        argv = ["demo", "--disaggregation-mode", "decode", "--disaggregation-prefill-addr", address]
        decode = subprocess.run(
            _kvjax(*argv, "--disaggregation-decode-enable-radix-cache", "--json"),
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=180,
        )
        assert decode.returncode == 0, decode.stderr[-3000:]
        report = json.loads(decode.stdout)
        # the warm (disaggregated) run's tokens are the cold run's; nothing leaked on the decode side
        assert report["cold_equals_warm"] and report["leak_free"], report
        pd = report["disaggregation"]
        assert pd["failed_requests"] == 0 and pd["failed"] == [] and pd["pulls"] > 0, pd
        assert pd["reused_tokens"] > 0 and pd["pulled_tokens"] + pd["reused_tokens"] == report["prompt_tokens"], pd
    finally:
        prefill.send_signal(signal.SIGTERM)
        code = prefill.wait(timeout=30)
    prefill_log.seek(0)
    assert code == 0, prefill_log.read()[-3000:]
