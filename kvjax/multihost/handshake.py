"""The rendezvous handshake of ``SocketChannel``: a challenge-response over a fresh TCP connection
that proves both ends hold the group's ``ClusterSecret`` before process 0 serves the peer, and
gives the connection its own frame key.

Bytes, in order (integers little endian):

1. peer -> process 0, the hello (``HELLO_SIZE`` = 42 bytes): ``b"KVJX"``, the handshake
   version (u16, ``HANDSHAKE_VERSION``), the peer's process id (u32), the peer's nonce (32
   random bytes);
2. process 0 -> peer: process 0's nonce (32 random bytes), then process 0's proof
   ``HMAC(secret, "server" | peer nonce | process 0 nonce | id)`` (32 bytes);
3. peer -> process 0: the peer's proof ``HMAC(secret, "client" | process 0 nonce | peer nonce |
   id)`` (32 bytes);
4. process 0 -> peer: ``WELCOME`` (1 byte) once it accepted the peer.

Both nonces are fresh per connection, so an answer recorded from another connection (a replay)
proves nothing; the two proofs have different labels, so one cannot be reflected as the other.
The connection's frame key (``frame_auth``) is derived from the secret and both nonces.

Process 0 reads the magic first and refuses at once what is not a hello (a pickle, an HTTP
request: nothing a peer sent is ever interpreted beyond these fixed fields). A refusal
(`Refused`) names the reason; the rendezvous closes the connection, logs its address and goes
on waiting for the real peers. Each handshake is bounded by its own deadline (a silent
connection holds the rendezvous at most ``HANDSHAKE_TIMEOUT_S``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
from collections.abc import Collection

from kvjax.multihost.cluster_secret import CLUSTER_SECRET_ENV, ClusterSecret
from kvjax.multihost.errors import AuthenticationError
from kvjax.multihost.frame_auth import derive_key
from kvjax.multihost.socket_io import ConnectionLost, read_exact, send_all

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "HANDSHAKE_VERSION",
    "HELLO_SIZE",
    "Refused",
    "accept_peer",
    "client_proof",
    "connection_key",
    "hello",
    "join_process_zero",
    "server_proof",
]

MAGIC = b"KVJX"
HANDSHAKE_VERSION = 1
NONCE_SIZE = 32
PROOF_SIZE = 32
WELCOME = b"\x01"
#: The longest one connection's handshake may hold process 0's rendezvous (seconds).
HANDSHAKE_TIMEOUT_S = 5.0

_HELLO_REST = struct.Struct("<HI")  # version, process id
HELLO_SIZE = len(MAGIC) + _HELLO_REST.size + NONCE_SIZE


class Refused(Exception):
    """Process 0 refused a connection during the rendezvous: ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _proof(secret: ClusterSecret, label: bytes, first: bytes, second: bytes, process_id: int) -> bytes:
    mac = hmac.new(secret.key, b"kvjax handshake " + label, hashlib.sha256)
    mac.update(first)
    mac.update(second)
    mac.update(struct.pack("<I", process_id))
    return mac.digest()


def server_proof(secret: ClusterSecret, peer_nonce: bytes, zero_nonce: bytes, process_id: int) -> bytes:
    """Process 0's proof that it holds ``secret``, for this connection's nonces."""
    return _proof(secret, b"server", peer_nonce, zero_nonce, process_id)


def client_proof(secret: ClusterSecret, zero_nonce: bytes, peer_nonce: bytes, process_id: int) -> bytes:
    """The peer's proof that it holds ``secret``, for this connection's nonces."""
    return _proof(secret, b"client", zero_nonce, peer_nonce, process_id)


def connection_key(secret: ClusterSecret, zero_nonce: bytes, peer_nonce: bytes, process_id: int) -> bytes:
    """The frame key of one connection (``frame_auth``)."""
    return derive_key(secret, b"socket channel", zero_nonce, peer_nonce, struct.pack("<I", process_id))


def hello(process_id: int, nonce: bytes) -> bytes:
    """A peer's hello (step 1 of the module docstring)."""
    return MAGIC + _HELLO_REST.pack(HANDSHAKE_VERSION, process_id) + nonce


def accept_peer(
    conn: socket.socket, secret: ClusterSecret, num_processes: int, joined: Collection[int], deadline: float
) -> tuple[int, bytes]:
    """Process 0's side of the handshake on a new connection: the peer's process id and the
    connection's frame key. ``joined``: the peers accepted so far.

    Raises:
        Refused: the connection is not a kvjax peer of this group (not a hello, another
            version, an id out of range or already joined, a proof that fails, silence past
            ``deadline``); the caller closes it and logs its address.
    """
    try:
        magic = read_exact(conn, len(MAGIC), deadline)
        if magic != MAGIC:
            raise Refused(f"it sent {magic!r}, not a rendezvous hello (not a kvjax peer)")
        version, process_id = _HELLO_REST.unpack(read_exact(conn, _HELLO_REST.size, deadline))
        if version != HANDSHAKE_VERSION:
            raise Refused(f"it speaks handshake version {version}, this process {HANDSHAKE_VERSION}")
        if not 0 < process_id < num_processes:
            raise Refused(f"it claims process id {process_id}; this group's peers are 1 to {num_processes - 1}")
        if process_id in joined:
            raise Refused(f"it claims process id {process_id}, which already joined")
        peer_nonce = read_exact(conn, NONCE_SIZE, deadline)
        zero_nonce = secrets.token_bytes(NONCE_SIZE)
        send_all(conn, zero_nonce + server_proof(secret, peer_nonce, zero_nonce, process_id), deadline)
        answer = read_exact(conn, PROOF_SIZE, deadline)
        if not hmac.compare_digest(answer, client_proof(secret, zero_nonce, peer_nonce, process_id)):
            raise Refused(
                f"its answer to the challenge (as process {process_id}) failed authentication: it does not hold the "
                "cluster secret, or replayed an old answer"
            )
        send_all(conn, WELCOME, deadline)
    except ConnectionLost as e:
        raise Refused(f"the handshake did not complete ({e.reason})") from None
    return process_id, connection_key(secret, zero_nonce, peer_nonce, process_id)


def join_process_zero(
    conn: socket.socket, secret: ClusterSecret, process_id: int, address: str, deadline: float
) -> bytes:
    """A peer's side of the handshake with process 0 at ``address`` (``host:port``, for the
    messages): the connection's frame key.

    Raises:
        AuthenticationError: process 0's proof failed (the secrets differ, or the address is not
            process 0's).
        ConnectionLost: process 0 closed the connection (it refused this process) or stayed
            silent past ``deadline``.
    """
    peer_nonce = secrets.token_bytes(NONCE_SIZE)
    send_all(conn, hello(process_id, peer_nonce), deadline)
    zero_nonce = read_exact(conn, NONCE_SIZE, deadline)
    proof = read_exact(conn, PROOF_SIZE, deadline)
    if not hmac.compare_digest(proof, server_proof(secret, peer_nonce, zero_nonce, process_id)):
        raise AuthenticationError(
            address,
            f"process 0's answer at {address} failed authentication: process {process_id}'s cluster secret differs "
            f"from process 0's (give every process the same {CLUSTER_SECRET_ENV}), or {address} is not process 0; "
            "the connection is closed",
        )
    send_all(conn, client_proof(secret, zero_nonce, peer_nonce, process_id), deadline)
    if read_exact(conn, len(WELCOME), deadline) != WELCOME:
        raise ConnectionLost("process 0 did not welcome this process")
    return connection_key(secret, zero_nonce, peer_nonce, process_id)
