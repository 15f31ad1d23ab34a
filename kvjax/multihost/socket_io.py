"""`read_exact` and `send_all`: bounded reads and writes on a socket, and `ConnectionLost`,
what it raises when the bytes do not come.

Invariant: every read ends by ``deadline`` (``time.monotonic()`` seconds): a peer that stays
silent, closes or fails is reported, never waited on past it.
"""

from __future__ import annotations

import socket
import time

__all__ = ["ConnectionLost", "read_exact", "send_all"]


class ConnectionLost(Exception):
    """A read or write on a peer's connection failed: ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes from ``sock`` before ``deadline``; ``ConnectionLost`` when the connection
    closed, failed or the deadline passed."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConnectionLost("timed out")
        try:
            sock.settimeout(remaining)
            count = sock.recv_into(view[got:])
        except TimeoutError:
            raise ConnectionLost("timed out") from None
        except OSError as e:
            raise ConnectionLost(f"connection failed: {e}") from None
        if count == 0:
            raise ConnectionLost("its connection closed")
        got += count
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Write ``data`` to ``sock`` before ``deadline``; ``ConnectionLost`` when it fails."""
    try:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        sock.sendall(data)
    except OSError as e:
        raise ConnectionLost(f"sending failed: {e}") from None
