"""Authentication of the multi-process wire: rogue clients connecting during the socket
rendezvous (a pickle payload, a wrong HMAC, a replayed answer, a peer with another secret) are
refused, closed and named in the log while the real group completes and exchanges correctly; a
replayed or altered frame after the rendezvous, and a forged or moved value in the key-value
store, stop the run with an ``AuthenticationError``; no secret, no group; the launcher hands its
processes a fresh secret through the environment only. One process, threads, loopback TCP, every
wait bounded."""

from __future__ import annotations

import io
import logging
import pickle
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvjax.multihost import handshake
from kvjax.multihost.agreement import AgreedValues
from kvjax.multihost.channel import ProcessChannel, agree_session, all_gather_message
from kvjax.multihost.cluster_secret import CLUSTER_SECRET_ENV, ClusterSecret, MissingSecretError
from kvjax.multihost.errors import AuthenticationError
from kvjax.multihost.frame_auth import FrameSealer
from kvjax.multihost.process_group import ProcessFlags, initialize
from kvjax.multihost.socket_channel import SocketChannel, _frame
from kvjax.serve.multihost import launcher
from tests.multihost.memory_store import SECRET, MemoryStore

UNPICKLED: list[str] = []  # what a rogue pickle would append to, were it ever loaded


class Evil:
    """A pickle that records its own loading (and could do anything else)."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (UNPICKLED.append, ("a rogue pickle was loaded",))


def in_threads(*bodies: Callable[[], Any], timeout: float = 30) -> list[Any]:
    """Run each body in its own thread at once; each one's result or exception."""
    results: list[Any] = [None] * len(bodies)

    def run(i: int) -> None:
        try:
            results[i] = bodies[i]()
        except Exception as e:  # noqa: BLE001  returned for the test to check
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread outlived its bound"
    return results


def closed_by_peer(sock: socket.socket, timeout: float = 10) -> bool:
    """Whether the other end closes ``sock`` within ``timeout`` s (after any bytes it sent)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def local_address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def test_rogue_clients_during_the_rendezvous_are_refused_and_named_and_the_group_completes(caplog):
    caplog.set_level(logging.WARNING, logger="kvjax.multihost")
    store = MemoryStore()
    channels: list[Any] = [None] * 3
    zero = threading.Thread(
        target=lambda: channels.__setitem__(
            0, SocketChannel.connect(store, 0, 3, host="127.0.0.1", secret=SECRET, timeout_s=20)
        )
    )
    zero.start()
    host, _, port = store.blocking_key_value_get_bytes("kvjax/socket", 10_000).decode().rpartition(":")
    rogues: dict[str, socket.socket] = {}

    # 1. A pickle payload instead of a hello.
    rogue = rogues["pickle"] = socket.create_connection((host, int(port)), timeout=10)
    rogue.sendall(pickle.dumps(Evil()))
    assert closed_by_peer(rogue)

    # 2. A well-formed hello (claiming process 1), then an answer with a wrong HMAC.
    rogue = rogues["wrong hmac"] = socket.create_connection((host, int(port)), timeout=10)
    nonce = secrets.token_bytes(32)
    rogue.sendall(handshake.hello(1, nonce))
    zero_nonce = rogue.recv(32, socket.MSG_WAITALL)
    rogue.recv(32, socket.MSG_WAITALL)  # process 0's proof: useless without the secret
    other = ClusterSecret.generate()
    rogue.sendall(handshake.client_proof(other, zero_nonce, nonce, 1))
    assert closed_by_peer(rogue)

    # 3. A replay: a real peer's hello and answer recorded from another rendezvous (valid then).
    recorded_zero_nonce, recorded_nonce = secrets.token_bytes(32), secrets.token_bytes(32)
    recorded_answer = handshake.client_proof(SECRET, recorded_zero_nonce, recorded_nonce, 2)
    rogue = rogues["replay"] = socket.create_connection((host, int(port)), timeout=10)
    rogue.sendall(handshake.hello(2, recorded_nonce) + recorded_answer)
    assert closed_by_peer(rogue)

    # 4. A process with another secret: it refuses process 0's answer, process 0 refuses it.
    (impostor,) = in_threads(lambda: SocketChannel.connect(store, 1, 3, host="127.0.0.1", secret=other, timeout_s=10))
    assert isinstance(impostor, AuthenticationError), impostor
    assert "process 0's answer" in str(impostor) and "cluster secret differs" in str(impostor)

    # The real peers join the same rendezvous and the group exchanges correctly.
    joined = in_threads(
        lambda: SocketChannel.connect(store, 1, 3, host="127.0.0.1", secret=SECRET, timeout_s=10),
        lambda: SocketChannel.connect(store, 2, 3, host="127.0.0.1", secret=SECRET, timeout_s=10),
    )
    zero.join(timeout=30)
    assert not zero.is_alive() and isinstance(channels[0], SocketChannel), channels
    channels[1:] = joined
    gathered = in_threads(
        *(lambda ch=ch: all_gather_message(ch, "ids", AgreedValues((ch.process_id * 10, 7))) for ch in channels)
    )
    assert gathered == [[AgreedValues((0, 7)), AgreedValues((10, 7)), AgreedValues((20, 7))]] * 3
    assert [ch.exchanges for ch in channels] == [1, 1, 1]

    refusals = [r.getMessage() for r in caplog.records if "refused the connection from" in r.getMessage()]
    assert len(refusals) == 4, refusals
    reasons = {
        "pickle": "not a rendezvous hello (not a kvjax peer)",
        "wrong hmac": "as process 1) failed authentication",
        "replay": "as process 2) failed authentication: it does not hold the cluster secret, or replayed",
    }
    for name, sock in rogues.items():
        line = next((m for m in refusals if f"from {local_address(sock)} " in m), None)
        assert line is not None and reasons[name] in line, (name, refusals)
        sock.close()
    assert any("the handshake did not complete" in m for m in refusals), refusals  # the impostor
    assert not UNPICKLED
    assert not store.data, "process 0 deleted its address once the group joined"
    for ch in channels:
        ch.close()


def test_a_silent_connection_delays_the_rendezvous_by_its_bound_only(caplog, monkeypatch):
    monkeypatch.setattr("kvjax.multihost.socket_channel.HANDSHAKE_TIMEOUT_S", 0.3)
    caplog.set_level(logging.WARNING, logger="kvjax.multihost")
    store = MemoryStore()

    def silent_then_real() -> Any:
        address = store.blocking_key_value_get_bytes("kvjax/socket", 10_000).decode()
        host, _, port = address.rpartition(":")
        silent = socket.create_connection((host, int(port)), timeout=10)
        try:
            return SocketChannel.connect(store, 1, 2, host="127.0.0.1", secret=SECRET, timeout_s=10)
        finally:
            silent.close()

    start = time.monotonic()
    zero, one = in_threads(
        lambda: SocketChannel.connect(store, 0, 2, host="127.0.0.1", secret=SECRET, timeout_s=10), silent_then_real
    )
    assert isinstance(zero, SocketChannel) and isinstance(one, SocketChannel), (zero, one)
    assert time.monotonic() - start < 5
    assert any("the handshake did not complete (timed out)" in r.getMessage() for r in caplog.records)
    zero.close()
    one.close()


def socket_pair() -> tuple[SocketChannel, SocketChannel, socket.socket, bytes]:
    """Processes 0 and 1 over a socket pair with one frame key; process 1's raw socket; the key."""
    a, b = socket.socketpair()
    key = secrets.token_bytes(32)
    zero = SocketChannel({1: a}, 0, 2, keys={1: key}, timeout_s=5)
    one = SocketChannel({0: b}, 1, 2, keys={0: key}, timeout_s=5)
    return zero, one, b, key


@pytest.mark.parametrize("attack", ["replay", "alter", "no key"])
def test_a_replayed_altered_or_unsealed_frame_stops_the_exchange(attack, caplog):
    caplog.set_level(logging.WARNING, logger="kvjax.multihost")
    zero, one, raw, key = socket_pair()
    first = _frame(0, "step", b"payload")
    assert (
        in_threads(lambda: zero.all_gather("step", b"p0"), lambda: one.all_gather("step", b"payload"))
        == [[b"p0", b"payload"]] * 2
    )
    recorded = first + FrameSealer(key, 1, 0).seal(first)  # process 1's frame of exchange 0, as sent
    if attack == "replay":
        forged = recorded
    elif attack == "alter":
        second = _frame(1, "step", b"payload")
        sealer = FrameSealer(key, 1, 0)
        sealer.seal(first)  # exchange 0's frame went before
        sealed = bytearray(second + sealer.seal(second))  # exchange 1's frame, as process 1 would seal it
        sealed[-33] ^= 1  # one payload bit: its MAC no longer matches
        forged = bytes(sealed)
    else:
        second = _frame(1, "step", b"payload")
        forged = second + b"\0" * 32
    raw.sendall(forged)
    with pytest.raises(AuthenticationError, match=r"a frame from process 1 .* at exchange 1 \('step'\) failed") as e:
        zero.all_gather("step", b"p0")
    assert e.value.peer == "process 1"
    assert "closed the connection" in str(e.value)
    assert any("failed authentication" in r.getMessage() for r in caplog.records)
    assert zero.peers[1].fileno() == -1  # closed
    one.close()


def test_a_forged_or_moved_value_in_the_key_value_store_is_refused():
    store = MemoryStore()
    zero = ProcessChannel(store, 0, 2, secret=SECRET, timeout_s=2)
    store.key_value_set_bytes("kvjax/1/0/0", pickle.dumps(("step", pickle.dumps(Evil()))))  # a rogue's pickle
    with pytest.raises(AuthenticationError, match=r"'kvjax/1/0/0' \(process 1, exchange 0\) failed authentication"):
        zero.all_gather("step", b"")
    assert not UNPICKLED

    store = MemoryStore()
    channels = [ProcessChannel(store, i, 2, secret=SECRET, timeout_s=2) for i in range(2)]
    assert in_threads(*(lambda ch=ch: ch.all_gather("step", b"x") for ch in channels)) == [[b"x", b"x"]] * 2
    store.key_value_set_bytes("kvjax/1/0/1", store.data["kvjax/1/0/0"])  # exchange 0's value replayed at 1
    with pytest.raises(AuthenticationError, match=r"'kvjax/1/0/1' \(process 1, exchange 1\) failed"):
        channels[0].all_gather("step", b"x")


def test_the_session_separates_runs_and_secrets():
    store = MemoryStore()
    session = agree_session(store, 0, SECRET)
    assert agree_session(store, 1, SECRET) == session and len(session) == 32
    with pytest.raises(AuthenticationError, match="cluster secret differs from process 0's"):
        agree_session(store, 1, ClusterSecret.generate())
    # A value sealed in another run (another session) fails in this one.
    old, new = MemoryStore(), MemoryStore()
    old_run = ProcessChannel(old, 1, 2, secret=SECRET, session=b"run 1", timeout_s=0.2)
    this_run = ProcessChannel(new, 0, 2, secret=SECRET, session=b"run 2", timeout_s=2)
    in_threads(lambda: old_run.all_gather("step", b""), timeout=5)  # posts, then waits for process 0 in vain
    new.key_value_set_bytes("kvjax/1/0/0", old.data["kvjax/1/0/0"])
    with pytest.raises(AuthenticationError, match="failed authentication"):
        this_run.all_gather("step", b"")


def test_without_a_secret_a_group_does_not_start(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    with pytest.raises(MissingSecretError, match=f"no cluster secret: .*export the same {CLUSTER_SECRET_ENV}"):
        SocketChannel.connect(MemoryStore(), 0, 2, host="127.0.0.1", timeout_s=1)
    with pytest.raises(MissingSecretError, match="no cluster secret"):
        ProcessChannel(MemoryStore(), 0, 2)
    start = time.monotonic()
    with pytest.raises(MissingSecretError, match="no cluster secret"):  # before contacting the coordinator
        initialize(ProcessFlags(coordinator_address="127.0.0.1:9", num_processes=2, process_id=1, timeout_s=30))
    assert time.monotonic() - start < 5
    for bad, says in (("zz" * 32, "is not hex text"), ("ab" * 8, "has 8 bytes; give at least 32 hex digits")):
        monkeypatch.setenv(CLUSTER_SECRET_ENV, bad)
        with pytest.raises(MissingSecretError, match=says) as e:
            ClusterSecret.resolve()
        assert bad not in str(e.value) and CLUSTER_SECRET_ENV in str(e.value)
    monkeypatch.setenv(CLUSTER_SECRET_ENV, SECRET.hex())
    assert ClusterSecret.resolve() == SECRET


def test_the_secret_never_shows():
    flags = ProcessFlags(num_processes=2, process_id=0, secret=SECRET)
    assert SECRET.hex() not in repr(flags) and SECRET.hex() not in repr(SECRET)
    assert repr(SECRET) == "ClusterSecret(<hidden>)"


def test_the_launcher_hands_each_launch_its_secret_through_the_environment_only(monkeypatch):
    started: list[tuple[list[str], dict[str, str]]] = []

    class Done:
        pid = 1
        stdout: Any = io.StringIO("")
        stderr: Any = io.StringIO("")

        def __init__(self, argv: list[str], **kwargs: Any) -> None:
            started.append((argv, kwargs["env"]))

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(launcher.subprocess, "Popen", Done)
    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    log = io.StringIO()
    assert launcher.launch(["demo"], 2, log=log) == 0
    assert launcher.launch(["demo"], 2, log=log) == 0
    secrets_seen = [env[CLUSTER_SECRET_ENV] for _, env in started]
    assert secrets_seen[0] == secrets_seen[1] != secrets_seen[2] == secrets_seen[3]  # one per launch
    assert all(ClusterSecret.from_hex(s) for s in secrets_seen)
    # an exported secret is the launch's (a side of a disaggregated pair shares it with the other side)
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "ab" * 32)
    assert launcher.launch(["demo"], 2, log=log) == 0
    assert [env[CLUSTER_SECRET_ENV] for _, env in started[4:]] == ["ab" * 32] * 2
    for argv, env in started:
        assert not any(env[CLUSTER_SECRET_ENV] in arg for arg in argv)
        assert env[CLUSTER_SECRET_ENV] not in log.getvalue()


def test_the_demo_without_a_secret_is_one_clear_error(capsys, monkeypatch):
    from kvjax.cli import main

    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    argv = ["demo", "--num-processes", "2", "--process-id", "1", "--coordinator", "127.0.0.1:9"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no cluster secret" in err and CLUSTER_SECRET_ENV in err and err.count("\n") == 1, err
