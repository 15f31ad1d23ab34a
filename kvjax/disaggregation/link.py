"""`PDLink`: an authenticated, framed TCP connection between a decode server and a prefill server.

Handshake (integers little endian), before any message:

1. decode -> prefill: ``b"KVPD"``, the version (u16, ``LINK_VERSION``), a fresh 32-byte nonce;
2. prefill -> decode: its fresh nonce and its proof ``HMAC(secret, "pd prefill" | decode nonce |
   prefill nonce)``;
3. decode -> prefill: its proof ``HMAC(secret, "pd decode" | prefill nonce | decode nonce)``;
4. prefill -> decode: ``WELCOME``.

Both sides hold the cluster secret (``kvjax.multihost.cluster_secret``: ``KVJAX_CLUSTER_SECRET``),
as sglang-jax's two sides share theirs; fresh nonces on both sides make a recorded answer worthless.
The link's key is derived from the secret and both nonces. Then every frame is::

    length (u32, of what follows up to the tag) | kind (u8) | message (JSON) | tag (32 bytes)

with the tag an HMAC over the direction and the frame's place in it (``FrameSealer``): a frame
altered, replayed, reordered or not sealed with the link's key ends the link (`LinkError`). A frame
is decoded only through the kind table (``messages.KINDS``) as strict JSON (``kvjax.multihost.wire``):
nothing received is unpickled or picks a class. Every read and write has a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import select
import socket
import struct
import time
from typing import Any

from kvjax.disaggregation.messages import KINDS
from kvjax.multihost.cluster_secret import CLUSTER_SECRET_ENV, ClusterSecret
from kvjax.multihost.frame_auth import MAC_SIZE, FrameOpener, FrameSealer, derive_key
from kvjax.multihost.socket_io import ConnectionLost, read_exact, send_all
from kvjax.multihost.wire import WireError, decode, encode

__all__ = ["LINK_VERSION", "LinkError", "PDLink", "accept_link", "connect_link", "listen"]

log = logging.getLogger("kvjax.disaggregation")

MAGIC = b"KVPD"
LINK_VERSION = 1
NONCE_SIZE = 32
WELCOME = b"\x01"
#: The longest a handshake may take (seconds).
HANDSHAKE_TIMEOUT_S = 5.0
#: The largest frame accepted (bytes): a prompt of a million token ids fits.
MAX_FRAME = 16 << 20

_HELLO = struct.Struct("<H")
_KIND_OF = {cls: kind for kind, cls in KINDS.items()}
_DECODE_SIDE, _PREFILL_SIDE = 1, 0


class LinkError(Exception):
    """The link failed: the peer is gone, silent past a deadline, or sent what does not
    authenticate or decode. ``peer``: its address."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"the link with {peer} failed: {reason}")
        self.peer = peer
        self.reason = reason


def _proof(secret: ClusterSecret, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret.key, label + first + second, hashlib.sha256).digest()


class PDLink:
    """One side of an authenticated link (see the module docstring); ``peer``: the other end's
    ``host:port``. Not thread-safe: one owner sends and receives."""

    def __init__(self, sock: socket.socket, key: bytes, *, decode_side: bool, peer: str) -> None:
        me, other = (_DECODE_SIDE, _PREFILL_SIDE) if decode_side else (_PREFILL_SIDE, _DECODE_SIDE)
        self.sock = sock
        self.peer = peer
        self._sealer = FrameSealer(key, me, other)
        self._opener = FrameOpener(key, other, me)
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any, timeout_s: float = 10.0) -> None:
        """Send one message (a type of ``messages.KINDS``) before ``timeout_s``."""
        body = bytes([_KIND_OF[type(message)]]) + encode(message)
        if len(body) > MAX_FRAME:  # the peer would refuse it: refuse it here, the link intact
            raise LinkError(
                self.peer, f"a {type(message).__name__} of {len(body)} bytes (a frame is at most {MAX_FRAME})"
            )
        frame = struct.pack("<I", len(body)) + body
        try:
            send_all(self.sock, frame + self._sealer.seal(body), time.monotonic() + timeout_s)
        except ConnectionLost as e:
            self.close()
            raise LinkError(self.peer, e.reason) from None

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether a frame (or the peer's close) waits to be read, within ``timeout_s``."""
        if self.closed:
            return False
        readable, _, _ = select.select([self.sock], [], [], max(timeout_s, 0.0))
        return bool(readable)

    def receive(self, timeout_s: float = 10.0) -> Any:
        """The next message, before ``timeout_s``; ``LinkError`` (the link closed) when none came,
        the peer closed, or the frame fails authentication or decoding."""
        deadline = time.monotonic() + timeout_s
        try:
            (size,) = struct.unpack("<I", read_exact(self.sock, 4, deadline))
            if not 1 <= size <= MAX_FRAME:
                raise LinkError(self.peer, f"a frame of {size} bytes (at most {MAX_FRAME})")
            body = read_exact(self.sock, size, deadline)
            tag = read_exact(self.sock, MAC_SIZE, deadline)
        except ConnectionLost as e:
            self.close()
            raise LinkError(self.peer, e.reason) from None
        except LinkError:
            self.close()
            raise
        if not self._opener.verify(tag, body):
            self.close()
            raise LinkError(self.peer, "a frame failed authentication (altered, replayed or not sealed with the key)")
        cls = KINDS.get(body[0])
        if cls is None:
            self.close()
            raise LinkError(self.peer, f"a frame of unknown kind {body[0]}")
        try:
            return decode(body[1:], cls)
        except WireError as e:
            self.close()
            raise LinkError(self.peer, f"a malformed {cls.__name__}: {e}") from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket (``port`` 0: a free one; read it from ``getsockname()``)."""
    server = socket.create_server((host, port), reuse_port=False)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return server


def accept_link(server: socket.socket, secret: ClusterSecret, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> PDLink:
    """The prefill side: accept one connection and run the handshake. ``LinkError`` (the
    connection closed) when it is not a decode server holding the secret."""
    conn, address = server.accept()
    peer = f"{address[0]}:{address[1]}"
    deadline = time.monotonic() + timeout_s
    try:
        magic = read_exact(conn, len(MAGIC), deadline)
        if magic != MAGIC:
            raise LinkError(peer, f"it sent {magic!r}, not a kvjax decode server's hello")
        (version,) = _HELLO.unpack(read_exact(conn, _HELLO.size, deadline))
        if version != LINK_VERSION:
            raise LinkError(peer, f"it speaks link version {version}, this server {LINK_VERSION}")
        theirs = read_exact(conn, NONCE_SIZE, deadline)
        mine = secrets.token_bytes(NONCE_SIZE)
        send_all(conn, mine + _proof(secret, b"pd prefill", theirs, mine), deadline)
        answer = read_exact(conn, hashlib.sha256().digest_size, deadline)
        if not hmac.compare_digest(answer, _proof(secret, b"pd decode", mine, theirs)):
            raise LinkError(peer, "its answer failed authentication: it does not hold the cluster secret")
        send_all(conn, WELCOME, deadline)
    except ConnectionLost as e:
        conn.close()
        raise LinkError(peer, f"the handshake did not complete ({e.reason})") from None
    except LinkError:
        conn.close()
        raise
    return PDLink(conn, derive_key(secret, b"pd link", theirs, mine), decode_side=False, peer=peer)


def connect_link(address: str, secret: ClusterSecret, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> PDLink:
    """The decode side: connect to the prefill server's bootstrap ``address`` (``host:port``)
    and run the handshake. ``LinkError`` when it cannot be reached or does not prove the secret."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bootstrap address {address!r}: give HOST:PORT, e.g. 127.0.0.1:8998")
    deadline = time.monotonic() + timeout_s
    try:
        conn = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as e:
        raise LinkError(address, f"cannot connect ({e})") from None
    try:
        mine = secrets.token_bytes(NONCE_SIZE)
        send_all(conn, MAGIC + _HELLO.pack(LINK_VERSION) + mine, deadline)
        theirs = read_exact(conn, NONCE_SIZE, deadline)
        proof = read_exact(conn, hashlib.sha256().digest_size, deadline)
        if not hmac.compare_digest(proof, _proof(secret, b"pd prefill", mine, theirs)):
            raise LinkError(
                address,
                f"the prefill server's proof failed authentication: its cluster secret differs (give both sides the "
                f"same {CLUSTER_SECRET_ENV}), or {address} is not a kvjax prefill server",
            )
        send_all(conn, _proof(secret, b"pd decode", theirs, mine), deadline)
        if read_exact(conn, len(WELCOME), deadline) != WELCOME:
            raise LinkError(address, "the prefill server did not welcome this server")
    except ConnectionLost as e:
        conn.close()
        raise LinkError(address, f"the handshake did not complete ({e.reason})") from None
    except LinkError:
        conn.close()
        raise
    return PDLink(conn, derive_key(secret, b"pd link", mine, theirs), decode_side=True, peer=address)
