"""The channels, the MIN agreement and the digest comparison, in one process: two channels, each
in its own thread, over an in-memory key-value store (what the coordination service keeps) or
over a connected socket pair (``SocketChannel``), and the socket channel's rendezvous over TCP on
loopback."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvjax.multihost.agreement import AgreedValues, LocalAgreement, ProcessAgreement, agree_statuses
from kvjax.multihost.channel import DELETE_BLOCK, ProcessChannel, all_gather_message
from kvjax.multihost.digest import compare_digests
from kvjax.multihost.errors import DivergenceError, ProcessLostError
from kvjax.multihost.socket_channel import SocketChannel
from kvjax.tiers.copy_engine import TransferStatus
from tests.multihost.memory_store import SECRET, MemoryStore


def kv_channels(timeout_s: float, store: MemoryStore | None = None) -> list[Any]:
    """Processes 0 and 1's channels over one in-memory key-value store."""
    store = store if store is not None else MemoryStore()
    return [ProcessChannel(store, i, 2, secret=SECRET, timeout_s=timeout_s) for i in range(2)]


def socket_channels(timeout_s: float) -> list[Any]:
    """Processes 0 and 1's channels over a connected socket pair (one frame key, as a handshake
    gives both ends)."""
    a, b = socket.socketpair()
    key = secrets.token_bytes(32)
    return [
        SocketChannel({1: a}, 0, 2, keys={1: key}, timeout_s=timeout_s),
        SocketChannel({0: b}, 1, 2, keys={0: key}, timeout_s=timeout_s),
    ]


TRANSPORTS = {"kv": kv_channels, "socket": socket_channels}


@pytest.fixture(params=sorted(TRANSPORTS))
def make(request: Any) -> Callable[[float], list[Any]]:
    return TRANSPORTS[request.param]


def both(
    make: Callable[[float], list[Any]] | MemoryStore, body: Callable[[Any], Any], timeout_s: float = 2.0
) -> list[Any]:
    """Run ``body(channel)`` for processes 0 and 1 at once (channels from ``make``, or over the
    key-value store given); each one's result or exception."""
    results: list[Any] = [None, None]
    channels = kv_channels(timeout_s, make) if isinstance(make, MemoryStore) else make(timeout_s)

    def run(i: int) -> None:
        try:
            results[i] = body(channels[i])
        except Exception as e:  # noqa: BLE001  returned for the test to check
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_all_gather_and_broadcast_return_every_process_payload_in_order(make):
    def body(ch: Any) -> Any:
        gathered = ch.all_gather("x", f"p{ch.process_id}".encode())
        large = ch.all_gather("large", bytes([ch.process_id]) * 300_000)  # past one socket buffer
        return gathered, ch.broadcast("b", b"from zero" if ch.process_id == 0 else b"ignored"), large, ch.exchanges

    expected = ([b"p0", b"p1"], b"from zero", [b"\0" * 300_000, b"\1" * 300_000], 3)
    assert both(make, body) == [expected] * 2


def test_keys_are_deleted_a_block_at_a_time():
    store = MemoryStore()
    both(store, lambda ch: [ch.all_gather("x", b"") for _ in range(3 * DELETE_BLOCK + 1)])
    assert len(store.data) <= 2 * 2 * DELETE_BLOCK


def test_a_silent_process_is_named_within_the_bound(make):
    def body(ch: Any) -> Any:
        if ch.process_id == 1:
            return None  # never posts
        start = time.monotonic()
        with pytest.raises(ProcessLostError) as e:
            ch.all_gather("step", b"")
        return e.value, time.monotonic() - start

    (error, waited), _ = both(make, body, timeout_s=0.5)
    assert error.process_id == 1 and "process 1 sent nothing for exchange 0 ('step') within 0.5 s" in str(error)
    assert waited < 2


def test_processes_at_different_exchanges_are_a_divergence(make):
    results = both(make, lambda ch: ch.all_gather("step" if ch.process_id == 0 else "agree", b""))
    assert all(isinstance(r, DivergenceError) for r in results)
    assert "process 1 sent 'agree' where process 0 sent 'step'" in str(results[0])


def test_min_agreement_and_transfer_statuses(make):
    def body(ch: Any) -> Any:
        agreement = ProcessAgreement(ch)
        mins = agreement.agree_min("n", [3, 1] if ch.process_id == 0 else [2, 5])
        pending, failed, done = TransferStatus.PENDING, TransferStatus.FAILED, TransferStatus.DONE
        mine = [done, done, done] if ch.process_id == 0 else [pending, failed, done]
        return mins, agree_statuses(agreement, "t", mine), agreement.held_back

    (mins0, st0, held0), (mins1, st1, held1) = both(make, body)
    assert mins0 == mins1 == [2, 1]
    assert st0 == st1 == [TransferStatus.PENDING, TransferStatus.FAILED, TransferStatus.DONE]
    assert held0 == 3 and held1 == 1  # process 0 saw 3 > 2 and two finished transfers agreed lower
    assert LocalAgreement().agree_min("n", [4]) == [4]


def test_a_different_number_of_values_is_a_divergence(make):
    results = both(make, lambda ch: ProcessAgreement(ch).agree_min("n", [1] * (ch.process_id + 1)))
    assert all(isinstance(r, DivergenceError) for r in results)
    assert "process 0: 1, process 1: 2" in str(results[0])


def test_a_closed_connection_names_the_process_at_once():
    def body(ch: Any) -> Any:
        if ch.process_id == 1:
            ch.close()  # what the system does to a process that dies
            return None
        start = time.monotonic()
        with pytest.raises(ProcessLostError) as e:
            ch.all_gather("step", b"")
        return e.value, time.monotonic() - start

    (error, waited), _ = both(socket_channels, body, timeout_s=30)
    assert error.process_id == 1 and "its connection closed" in str(error) and waited < 5


def test_the_socket_rendezvous_connects_every_process_through_the_store():
    store = MemoryStore()
    channels: list[Any] = [None] * 3

    def join(i: int) -> None:
        channels[i] = SocketChannel.connect(store, i, 3, host="127.0.0.1", secret=SECRET, timeout_s=5)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not store.data, "process 0 deletes its address once everyone connected"
    results: list[Any] = [None] * 3

    def gather(i: int) -> None:
        results[i] = all_gather_message(channels[i], "ids", AgreedValues((i * 10,)))

    threads = [threading.Thread(target=gather, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [[AgreedValues((0,)), AgreedValues((10,)), AgreedValues((20,))]] * 3
    for ch in channels:
        ch.close()


def test_a_process_that_never_connects_is_named():
    with pytest.raises(ProcessLostError, match=r"processes \[1\] did not connect to process 0 within 0.3 s"):
        SocketChannel.connect(MemoryStore(), 0, 2, host="127.0.0.1", secret=SECRET, timeout_s=0.3)


def test_compare_digests_names_the_step_process_and_parts():
    same = {"tree": "a", "allocator": "b", "request_table": "c", "requests": "d"}
    compare_digests(3, [same, dict(same)])
    with pytest.raises(DivergenceError, match=r"step 7: process 1's tree, allocator differ") as e:
        compare_digests(7, [same, {**same, "tree": "x", "allocator": "y"}])
    assert e.value.step == 7
