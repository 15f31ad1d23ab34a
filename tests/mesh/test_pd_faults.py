"""Prefill/decode disaggregation under faults, as processes on loopback (issue 36; the tiny Llama of
``test_pd_llama``). Each side ends the stated way within its bound, the decode side never hangs
(every run is bounded) and leaks nothing (its report's ``leak_free``):

* a prefill server that dies when a pull order comes (before offering; or right after offering,
  its transfer connection open): the requests it could not serve fail naming it, within the
  decode side's timeout; the requests on a second, live prefill server are served (Transformers'
  tokens);
* a prefill server that stalls past the decode side's timeout: the request fails within the
  timeout and a small margin; the prefill side drops the snapshot on the decode side's ``Release``
  (none left, none dropped only because the link closed);
* refusals at the bootstrap port, before any request: a client sending a pickle or garbage is
  disconnected, a decode server with another cluster secret is refused naming the secret, one
  with another model fingerprint is refused naming both (``PDRefused``); the prefill server goes
  on serving a real decode server afterwards.

The link's own refusals (altered, replayed, malformed frames) are unit-tested in the main suite
(``tests/disaggregation/test_link.py``).
"""

from __future__ import annotations

import pickle
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.mesh.pd_pair import PrefillProcess, pd_env, run_decode
from tests.mesh.subprocess_run import ROOT

pytestmark = pytest.mark.mesh

MAX_NEW = 3
PROMPT = 20
#: every decode process must end within this (seconds): never a hang
DECODE_BOUND = 240
#: what a failure may take past the decode side's timeout on this shared CPU (seconds)
MARGIN = 3.0
SIDE = ("--tp", "2", "--page-size", "4")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from tests.mesh.tp_serving import family_config
    from tests.serve.parity_harness import saved_transformers_model

    return saved_transformers_model(family_config("llama"), tmp_path_factory, "pd-faults-llama", seed=3)


def _requests(vocab: int, names: str, seed: int = 7) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"rid": n, "prompt": rng.integers(0, vocab, PROMPT).tolist(), "max_new": MAX_NEW} for n in names]


def _served(hf: Any, report: dict[str, Any], request: dict[str, Any]) -> None:
    from tests.serve.parity_harness import hf_greedy

    rid = request["rid"]
    assert rid not in report["failed"], f"{rid} failed: {report['failed'].get(rid)}"
    want, _ = hf_greedy(hf, request["prompt"], MAX_NEW)
    assert report["outputs"][rid] == want, f"{rid}: {report['outputs'][rid]} != transformers {want}"


@pytest.mark.parametrize(("when", "lost", "lost_or_retried"), [("order", "a", "c"), ("offer", "c", "")])
def test_a_prefill_server_dying_at_the_pull_fails_only_its_requests(llama, tmp_path, when, lost, lost_or_retried):
    """Two prefill servers; the first exits hard (``os._exit``) at a pull order (``order``: the
    first, before answering; ``offer``: the second, right after offering the pieces, so that pull
    meets a transfer server dying under an open connection: a's pull landed). Round robin sends a
    and c to it, b and d to the live one. A request whose pull met the death fails (``lost``); at
    ``order``, c's first token may or may not have come before the death (its prefill may run in
    a later batch than a's): if it had, c fails with a; if not, c is sent again to the live server
    and served there (``lost_or_retried``).

    (Only a transfer server dying after offering but before the decode side's first connection to
    it can leave a pull waiting to the deadline: ``kv_transfer._reachable``.)"""
    hf, checkpoint = llama
    env = pd_env()
    timeout = 20.0
    # the two servers start side by side
    dying = PrefillProcess(checkpoint, env, *SIDE, "--die-on-pull", when, wait=False)
    live = PrefillProcess(checkpoint, env, *SIDE)
    dying.wait_address()
    try:
        requests = _requests(hf.config.vocab_size, "abcd")
        report = run_decode(
            checkpoint,
            env,
            [requests],
            tmp_path,
            *SIDE,
            "--prefill",
            f"{dying.address},{live.address}",
            "--timeout",
            str(timeout),
            timeout=DECODE_BOUND,
        )
    finally:
        live_report = live.stop() if live.proc.poll() is None else {}
        dying.proc.wait(30)
    assert dying.proc.returncode == 3, f"the dying prefill server exited with {dying.proc.returncode}"
    retried = [rid for rid in lost_or_retried if rid not in report["failed"]]
    lost += "".join(rid for rid in lost_or_retried if rid not in retried)
    assert sorted(report["failed"]) == list(lost), report["failed"]
    assert report["retried"] == len(retried), (report["retried"], retried)
    for rid in lost:
        reason = report["failed"][rid]
        assert dying.address in reason, f"{rid}: the lost prefill server is not named: {reason}"
        # from its first token (or its order, when none came) to its end
        assert report["waited"][rid] < timeout + MARGIN, f"{rid} failed after {report['waited'][rid]:.1f} s"
        assert len(report["outputs"][rid]) <= 1, f"{rid}: {report['outputs'][rid]} (at most the first token)"
    for r in requests:
        if r["rid"] not in lost:
            _served(hf, report, r)
    assert report["leak_free"], "decode side: slots or rows left after the failed requests"
    prefilled = 2 + len(retried)  # b and d, and a retried request
    want = {"leak_free": True, "snapshots": 0, "prefilled": prefilled, "dropped_with_link": 0}
    assert live_report == {**live_report, **want}


def test_a_stalled_prefill_server_fails_the_request_within_the_timeout(llama, tmp_path):
    """The prefill server sleeps past the decode side's timeout before answering the pull: the
    request fails within the timeout (and a margin), everything it took on the decode side is
    freed, and the prefill side drops the snapshot and its late offer on the ``Release``."""
    hf, checkpoint = llama
    env = pd_env()
    # the stall outlasts the longest failure the assertions below allow (timeout + MARGIN), so the
    # late offer can never arrive in time; the test's length is the stall's
    timeout = 2.0
    stall = timeout + MARGIN + 1.0
    # warmed: its first prefill is compiled before the decode side's deadline runs
    server = PrefillProcess(checkpoint, env, *SIDE, "--stall-pull", str(stall), "--warmup", str(PROMPT))
    try:
        report = run_decode(
            checkpoint,
            env,
            [_requests(hf.config.vocab_size, "s")],
            tmp_path,
            *SIDE,
            "--prefill",
            server.address,
            "--timeout",
            str(timeout),
            timeout=DECODE_BOUND,
        )
    finally:
        prefill_report = server.stop() if server.proc.poll() is None else {}
    reason = report["failed"].get("s", "")
    assert f"offered nothing within {timeout:g} s" in reason and server.address in reason, report["failed"]
    assert timeout - 0.5 < report["waited"]["s"] < timeout + MARGIN, f"failed {report['waited']['s']:.1f} s after"
    assert report["outputs"]["s"][:1] and len(report["outputs"]["s"]) == 1, "only the prefill server's first token"
    assert report["pulled_tokens"] == 0
    assert report["leak_free"]
    # released by the decode side's Release, not by the link closing at its exit
    assert prefill_report == {**prefill_report, "leak_free": True, "snapshots": 0, "dropped_with_link": 0}
    assert prefill_report["prefilled"] == 1


def _raw_client(address: str, payload: bytes) -> bytes:
    """Send ``payload`` to the bootstrap port; what came back before the server hung up."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(payload)
        received = b""
        try:
            while chunk := client.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
        return received


class _Evil:
    def __reduce__(self) -> Any:
        return (exec, ("open('PWNED', 'w').write('unpickled')",))


def test_refusals_at_the_bootstrap_port_then_a_real_decode_server(llama, tmp_path):
    hf, checkpoint = llama
    env = pd_env()
    server = PrefillProcess(checkpoint, env, *SIDE)
    requests = _requests(hf.config.vocab_size, "r")
    try:
        # a pickle (that would write a file if unpickled) and garbage: disconnected, nothing sent
        assert _raw_client(server.address, pickle.dumps(_Evil())) == b""
        assert _raw_client(server.address, b"\x00" * 64 + b"GET / HTTP/1.1\r\n\r\n") == b""
        # another cluster secret: refused at the handshake, naming the secret
        other = run_decode(
            checkpoint,
            pd_env(),
            [requests],
            tmp_path,
            *SIDE,
            "--prefill",
            server.address,
            timeout=DECODE_BOUND,
        )
        assert other["refused"].startswith("LinkError: "), other
        assert "cluster secret differs" in other["refused"] and "KVJAX_CLUSTER_SECRET" in other["refused"]
        # another model fingerprint: refused, naming both
        foreign = run_decode(
            checkpoint,
            env,
            [requests],
            tmp_path,
            *SIDE,
            "--prefill",
            server.address,
            "--fingerprint",
            "not-this-model",
            timeout=DECODE_BOUND,
        )
        assert foreign["refused"].startswith("PDRefused: "), foreign
        assert "model fingerprint 'not-this-model' differs from this server's '" in foreign["refused"], foreign
        # the prefill server goes on: a real decode server is served
        report = run_decode(
            checkpoint, env, [requests], tmp_path, *SIDE, "--prefill", server.address, timeout=DECODE_BOUND
        )
    finally:
        prefill_report = server.stop() if server.proc.poll() is None else {}
    _served(hf, report, requests[0])
    assert report["leak_free"]
    assert prefill_report == {**prefill_report, "leak_free": True, "snapshots": 0, "prefilled": 1}
    assert not (Path(ROOT) / "PWNED").exists(), "the prefill server unpickled what it was sent"  # its cwd
