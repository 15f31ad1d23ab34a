"""`PDLink`, the disaggregated servers' link, against what a hostile or broken peer sends (no jax):
a frame altered in flight, replayed, of an unknown kind, with fields of the wrong type, over the
size limit, a pickle (sealed or not); and the handshake against garbage, a pickle and another
cluster secret. Each is refused with a `LinkError` naming it, and the link is closed."""

from __future__ import annotations

import contextlib
import json
import pickle
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvjax.disaggregation import link as link_module
from kvjax.disaggregation.link import MAX_FRAME, LinkError, PDLink, accept_link, connect_link, listen
from kvjax.disaggregation.messages import PrefillOrder, Release
from kvjax.multihost.cluster_secret import ClusterSecret
from kvjax.multihost.frame_auth import MAC_SIZE, FrameSealer

KEY = secrets.token_bytes(32)
DECODE, PREFILL = 1, 0  # the link's side numbers (decode -> prefill frames are sealed 1 -> 0)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, PDLink]]:
    """A raw socket standing for the decode side (what it writes is what the prefill side's link
    reads) and the prefill side's `PDLink`."""
    raw, theirs = socket.socketpair()
    receiver = PDLink(theirs, KEY, decode_side=False, peer="decode-peer")
    yield raw, receiver
    raw.close()
    receiver.close()


def frames(*messages: Any) -> list[bytes]:
    """The bytes a decode-side link sends for ``messages``, one frame each (in order)."""
    a, b = socket.socketpair()
    sender = PDLink(a, KEY, decode_side=True, peer="prefill-peer")
    out = []
    try:
        for message in messages:
            sender.send(message)
            (size,) = struct.unpack("<I", b.recv(4, socket.MSG_WAITALL))
            out.append(struct.pack("<I", size) + b.recv(size + MAC_SIZE, socket.MSG_WAITALL))
    finally:
        sender.close()
        b.close()
    return out


def sealed(body: bytes, sequence: int = 0) -> bytes:
    """``body`` (kind byte and payload) framed and sealed with the link's key, as frame
    ``sequence`` of the decode -> prefill direction: authentic, whatever it holds."""
    sealer = FrameSealer(KEY, DECODE, PREFILL)
    sealer.sequence = sequence
    return struct.pack("<I", len(body)) + body + sealer.seal(body)


def refused(receiver: PDLink, *words: str) -> LinkError:
    with pytest.raises(LinkError) as info:
        receiver.receive(timeout_s=2.0)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert info.value.peer == "decode-peer"
    assert receiver.closed
    return info.value


ORDER = PrefillOrder("r1", (1, 2, 3), None)


def test_a_frame_round_trips(pair):
    raw, receiver = pair
    one, two = frames(ORDER, Release("r1"))
    raw.sendall(one + two)
    assert receiver.receive(2.0) == ORDER
    assert receiver.receive(2.0) == Release("r1")


@pytest.mark.parametrize("where", ["length", "kind", "message", "tag"])
def test_an_altered_frame_fails_authentication(pair, where):
    raw, receiver = pair
    frame = bytearray(frames(ORDER)[0])
    at = {"length": 0, "kind": 4, "message": 12, "tag": len(frame) - 1}[where]
    if where == "length":
        frame[0] -= 1  # one byte shorter: the last tag byte is left over
    else:
        frame[at] ^= 0x01
    raw.sendall(bytes(frame))
    refused(receiver, "failed authentication")


def test_a_replayed_frame_fails_authentication(pair):
    raw, receiver = pair
    frame = frames(ORDER)[0]
    raw.sendall(frame + frame)
    assert receiver.receive(2.0) == ORDER
    refused(receiver, "failed authentication", "replayed")


def test_frames_reordered_fail_authentication(pair):
    raw, receiver = pair
    one, two = frames(ORDER, Release("r1"))
    raw.sendall(two + one)
    refused(receiver, "failed authentication")


def test_a_frame_sealed_with_another_key_fails_authentication(pair):
    raw, receiver = pair
    body = bytes([4]) + json.dumps({"type": "pd.prefill"}).encode()
    raw.sendall(struct.pack("<I", len(body)) + body + FrameSealer(secrets.token_bytes(32), DECODE, PREFILL).seal(body))
    refused(receiver, "failed authentication")


def test_an_unknown_kind_is_refused(pair):
    raw, receiver = pair
    raw.sendall(sealed(bytes([99]) + b"{}"))
    refused(receiver, "unknown kind 99")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"room": 7, "input_ids": [1, 2], "extra_key": None}, "PrefillOrder.room"),
        ({"room": "r", "input_ids": [1, "2"], "extra_key": None}, "PrefillOrder.input_ids[1]"),
        ({"room": "r", "input_ids": [1, True], "extra_key": None}, "PrefillOrder.input_ids[1]"),
        ({"room": "r", "input_ids": 3, "extra_key": None}, "PrefillOrder.input_ids"),
        ({"room": "r", "input_ids": [1], "extra_key": None, "evil": "x"}, "PrefillOrder.evil"),
        ({"room": "r"}, "PrefillOrder.input_ids"),
    ],
    ids=["int-room", "str-token", "bool-token", "int-ids", "unknown-field", "missing-field"],
)
def test_wrong_type_fields_are_refused(pair, fields, named):
    raw, receiver = pair
    message = {"type": "pd.prefill", "version": 1, "fields": fields}
    raw.sendall(sealed(bytes([4]) + json.dumps(message).encode()))
    refused(receiver, "malformed PrefillOrder", named)


def test_another_message_type_under_a_kind_is_refused(pair):
    raw, receiver = pair
    message = {"type": "pd.release", "version": 1, "fields": {"room": "r"}}
    raw.sendall(sealed(bytes([4]) + json.dumps(message).encode()))  # kind 4 is PrefillOrder
    refused(receiver, "malformed PrefillOrder", "pd.release")


@pytest.mark.parametrize("size", [MAX_FRAME + 1, 0xFFFFFFFF, 0])
def test_a_frame_over_the_limit_or_empty_is_refused_before_it_is_read(pair, size):
    raw, receiver = pair
    raw.sendall(struct.pack("<I", size))  # nothing follows: the size alone is refused
    refused(receiver, f"a frame of {size} bytes", f"at most {MAX_FRAME}")


def test_a_sent_frame_over_the_limit_is_refused_before_it_travels(monkeypatch):
    monkeypatch.setattr(link_module, "MAX_FRAME", 64)
    a, b = socket.socketpair()
    sender = PDLink(a, KEY, decode_side=True, peer="prefill-peer")
    try:
        with pytest.raises(LinkError, match="at most 64"):
            sender.send(PrefillOrder("big", tuple(range(100)), None))
        assert not sender.closed
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)  # nothing was sent
        sender.send(Release("small"))  # the link goes on
    finally:
        sender.close()
        b.close()


class Evil:
    def __reduce__(self) -> Any:
        return (print, ("unpickled!",))


def test_a_pickle_payload_is_never_unpickled(pair, capsys):
    raw, receiver = pair
    raw.sendall(sealed(bytes([4]) + pickle.dumps(Evil())))  # authentic frame, pickle inside
    refused(receiver, "malformed PrefillOrder", "not UTF-8 JSON")
    assert "unpickled!" not in capsys.readouterr().out


def test_a_raw_pickle_fails_before_decoding(pair, capsys):
    raw, receiver = pair
    payload = pickle.dumps(Evil())
    raw.sendall(struct.pack("<I", len(payload)) + payload + b"\0" * MAC_SIZE)
    refused(receiver, "failed authentication")
    assert "unpickled!" not in capsys.readouterr().out


def test_a_silent_peer_times_out(pair):
    _, receiver = pair
    with pytest.raises(LinkError, match="timed out"):
        receiver.receive(timeout_s=0.2)


def test_a_closed_peer_is_named(pair):
    raw, receiver = pair
    raw.close()
    refused(receiver, "closed")


# --- the handshake ---------------------------------------------------------------------------------


SECRET = ClusterSecret.generate()


def accept_in_thread(server: socket.socket, secret: ClusterSecret) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["link"] = accept_link(server, secret, timeout_s=2.0)
        except LinkError as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def address(server: socket.socket) -> str:
    return f"127.0.0.1:{server.getsockname()[1]}"


def test_the_handshake_then_messages_both_ways():
    server = listen()
    try:
        thread, result = accept_in_thread(server, SECRET)
        decode_side = connect_link(address(server), SECRET, timeout_s=2.0)
        thread.join(5)
        prefill_side = result["link"]
        decode_side.send(ORDER)
        assert prefill_side.receive(2.0) == ORDER
        prefill_side.send(Release("r1"))
        assert decode_side.receive(2.0) == Release("r1")
        decode_side.close()
        prefill_side.close()
    finally:
        server.close()


@pytest.mark.parametrize(
    ("sent", "named"),
    [
        (pickle.dumps(Evil()), "not a kvjax decode server's hello"),
        (b"GET / HTTP/1.1\r\n\r\n", "not a kvjax decode server's hello"),
        (b"KVPD" + struct.pack("<H", 99) + bytes(32), "link version 99"),
        (b"KVPD", "did not complete"),
    ],
    ids=["pickle", "http", "version", "short"],
)
def test_the_handshake_refuses_what_is_not_a_decode_server(sent, named, capsys):
    server = listen()
    try:
        thread, result = accept_in_thread(server, SECRET)
        client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        client.sendall(sent)
        with contextlib.suppress(OSError):  # the server may have hung up already
            client.shutdown(socket.SHUT_WR)
        thread.join(5)
        assert not thread.is_alive()
        assert named in str(result["error"]), result
        with contextlib.suppress(ConnectionResetError):  # reset: disconnected with what it sent unread
            assert client.recv(1024) == b""  # disconnected, sent nothing
        client.close()
    finally:
        server.close()
    assert "unpickled!" not in capsys.readouterr().out


def test_another_cluster_secret_is_refused_on_both_sides():
    server = listen()
    try:
        thread, result = accept_in_thread(server, SECRET)
        with pytest.raises(LinkError, match="cluster secret differs") as info:
            connect_link(address(server), ClusterSecret.generate(), timeout_s=2.0)
        assert "KVJAX_CLUSTER_SECRET" in str(info.value)
        thread.join(5)
        assert isinstance(result.get("error"), LinkError), result
    finally:
        server.close()


def test_a_decode_side_answering_with_a_wrong_proof_is_refused():
    """A client that says hello right but cannot answer the prefill side's challenge."""
    server = listen()
    try:
        thread, result = accept_in_thread(server, SECRET)
        client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        client.sendall(b"KVPD" + struct.pack("<H", link_module.LINK_VERSION) + secrets.token_bytes(32))
        assert len(client.recv(64, socket.MSG_WAITALL)) == 64  # its nonce and proof
        client.sendall(bytes(32))
        thread.join(5)
        assert "does not hold the cluster secret" in str(result["error"])
        assert client.recv(1) == b""  # not welcomed
        client.close()
    finally:
        server.close()


def test_a_silent_client_is_dropped_within_the_handshake_bound():
    server = listen()
    try:
        client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        started = time.monotonic()
        with pytest.raises(LinkError, match="did not complete"):
            accept_link(server, SECRET, timeout_s=0.3)
        assert time.monotonic() - started < 2.0
        client.close()
    finally:
        server.close()
