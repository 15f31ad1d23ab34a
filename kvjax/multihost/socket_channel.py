"""`SocketChannel`: the serving loop's exchanges over direct TCP connections between process 0 and
every other process (a star), found once through the coordination service, each wait bounded.

The same primitive and invariants as ``channel.ProcessChannel``: ``all_gather(tag, payload) ->
[payload of process 0, 1, ...]``, every process making the same exchanges in the same order,
exchange ``n``'s tag checked against every other process's (a different one is a
``DivergenceError`` naming both), a process that sent nothing within ``timeout_s`` named in a
``ProcessLostError``. Only the transport differs: a call to the coordination service's key-value
store is a gRPC round trip (0.5 to 0.8 ms each on a loaded 2-core host, two of them per exchange),
where one message on an open TCP connection is a write and a read of a few dozen bytes.

Exchange ``n``: every other process sends its frame to process 0; process 0 reads one frame from
each (bounded), then sends every process's frame, in process order, to each of them, and each of
them reads those (bounded). So no process leaves exchange ``n`` before every process entered it
(at most one exchange ahead, as with the key-value store), and every process checks every tag
itself: on a mismatch every process raises. A process that dies closes its connection, and the
process reading from it names it at once rather than at the deadline; one that hangs is named at
the deadline.

Frame: ``<exchange u64><tag length u32><payload length u32><tag utf-8><payload>``, little endian.

Rendezvous (``connect``): process 0 listens on the address its host reaches the coordinator from
(``reachable_host``), posts ``host:port`` under ``<namespace>/socket`` in the coordination
service's key-value store, and accepts one connection from each other process, which first sends
its process id; every step is bounded by the join timeout. Process 0 deletes the key afterwards.
"""

from __future__ import annotations

import pickle
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

from kvjax.multihost.channel import DEFAULT_TIMEOUT_S, KeyValueClient
from kvjax.multihost.errors import DivergenceError, ProcessLostError

__all__ = ["SocketChannel", "reachable_host"]

_HEADER = struct.Struct("<QII")
_HELLO = struct.Struct("<I")


class _Lost(Exception):
    """A read or write on a peer's connection failed: ``reason`` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SocketChannel:
    """Exchanges between ``num_processes`` processes over ``peers`` (module docstring).

    Args:
        peers: the open connections: on process 0, one per other process (by process id); on
            any other process, ``{0: connection to process 0}``.
        timeout_s: the longest wait for another process's message, in seconds.

    Attributes:
        exchanges: exchanges completed (equal on every process).
    """

    def __init__(
        self,
        peers: Mapping[int, socket.socket],
        process_id: int,
        num_processes: int,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} is not in [0, {num_processes}); give 0 to num_processes - 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s {timeout_s} must be positive (seconds)")
        expected = set(range(1, num_processes)) if process_id == 0 else {0}
        if num_processes > 1 and set(peers) != expected:
            raise ValueError(
                f"process {process_id} of {num_processes} needs connections to processes {sorted(expected)}, "
                f"got {sorted(peers)}"
            )
        self.process_id = process_id
        self.num_processes = num_processes
        self.timeout_s = float(timeout_s)
        self.peers = dict(peers)
        for sock in self.peers.values():
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go out at once
        self.exchanges = 0

    # --- rendezvous -------------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        client: KeyValueClient,
        process_id: int,
        num_processes: int,
        *,
        host: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        join_timeout_s: float | None = None,
        namespace: str = "kvjax",
    ) -> SocketChannel:
        """Open the star of connections (module docstring). ``host``: the address process 0
        listens on (the others ignore it). Raises ``ProcessLostError`` naming the process that
        did not connect within ``join_timeout_s`` (default ``timeout_s``)."""
        bound = timeout_s if join_timeout_s is None else join_timeout_s
        key = f"{namespace}/socket"
        deadline = time.monotonic() + bound
        peers: dict[int, socket.socket] = {}
        if num_processes == 1:
            return cls(peers, process_id, num_processes, timeout_s=timeout_s)
        if process_id == 0:
            with socket.create_server((host, 0)) as server:
                client.key_value_set_bytes(key, f"{host}:{server.getsockname()[1]}".encode())
                while len(peers) < num_processes - 1:
                    server.settimeout(max(deadline - time.monotonic(), 1e-3))
                    try:
                        conn, _ = server.accept()
                        (peer,) = _HELLO.unpack(_read_exact(conn, _HELLO.size, deadline))
                    except (OSError, _Lost):
                        missing = sorted(set(range(1, num_processes)) - set(peers))
                        raise ProcessLostError(
                            missing[0],
                            f"processes {missing} did not connect to process 0 within {bound:g} s; they died or "
                            "cannot reach its address",
                        ) from None
                    peers[peer] = conn
            client.key_value_delete(key)
        else:
            try:
                address = client.blocking_key_value_get_bytes(key, int(bound * 1000)).decode()
            except Exception as e:  # noqa: BLE001  deadline exceeded, or the coordinator is gone
                raise ProcessLostError(
                    0, f"process 0 posted no address within {bound:g} s ({str(e).splitlines()[0] if str(e) else e})"
                ) from None
            addr_host, _, port = address.rpartition(":")
            try:
                conn = socket.create_connection((addr_host, int(port)), timeout=max(deadline - time.monotonic(), 1e-3))
                conn.sendall(_HELLO.pack(process_id))
            except OSError as e:
                reason = f"process {process_id} could not connect to process 0 at {address}: {e}"
                raise ProcessLostError(0, reason) from None
            peers[0] = conn
        return cls(peers, process_id, num_processes, timeout_s=timeout_s)

    @classmethod
    def from_jax(
        cls, *, timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float | None = None, namespace: str = "kvjax"
    ) -> SocketChannel:
        """The channel of the running ``jax.distributed`` group (``kvjax.multihost.initialize``
        first). Raises RuntimeError when jax.distributed is not initialized."""
        import jax
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialized: call kvjax.multihost.initialize first")
        return cls.connect(
            client,
            jax.process_index(),
            jax.process_count(),
            host=reachable_host(distributed.global_state.coordinator_address),
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
            namespace=namespace,
        )

    def close(self) -> None:
        """Close every connection (the others then see this process as gone)."""
        for sock in self.peers.values():
            sock.close()
        self.peers = {}

    # --- exchanges --------------------------------------------------------------------------------

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]:
        """Post ``payload`` for this exchange and return every process's, in process order.

        Raises:
            ProcessLostError: a process sent nothing within ``timeout_s`` or closed its
                connection (named, with the exchange and the tag).
            DivergenceError: a process sent another tag (the programs diverged).
        """
        n = self.exchanges
        if self.num_processes == 1:
            self.exchanges = n + 1
            return [payload]
        deadline = time.monotonic() + self.timeout_s
        mine = _frame(n, tag, payload)
        if self.process_id == 0:
            frames: list[tuple[str, bytes]] = [(tag, payload)]
            raw = [mine]
            for q in range(1, self.num_processes):
                their_tag, their_payload, frame = self._receive(q, n, tag, deadline)
                frames.append((their_tag, their_payload))
                raw.append(frame)
            everything = b"".join(raw)
            for q in range(1, self.num_processes):
                self._send(q, everything, n, tag, deadline)
        else:
            self._send(0, mine, n, tag, deadline)
            frames = [self._receive(0, n, tag, deadline)[:2] for _ in range(self.num_processes)]
        for q, (their_tag, _) in enumerate(frames):
            if their_tag != tag:
                raise DivergenceError(
                    n,
                    f"exchange {n}: process {q} sent {their_tag!r} where process {self.process_id} sent {tag!r}; "
                    "the processes' serving loops diverged",
                )
        self.exchanges = n + 1
        return [p for _, p in frames]

    def broadcast(self, tag: str, payload: bytes = b"") -> bytes:
        """Process 0's ``payload`` on every process (the others' ``payload`` is ignored)."""
        return self.all_gather(tag, payload if self.process_id == 0 else b"")[0]

    def all_gather_object(self, tag: str, value: Any) -> list[Any]:
        """``all_gather`` of a picklable value."""
        return [pickle.loads(b) for b in self.all_gather(tag, pickle.dumps(value))]

    def _receive(self, peer: int, n: int, tag: str, deadline: float) -> tuple[str, bytes, bytes]:
        """One frame from ``peer`` (the connection to process 0 on the others): its tag, payload
        and raw bytes. The frame's sender is ``peer`` on process 0; elsewhere any process."""
        sock = self.peers[peer]
        try:
            header = _read_exact(sock, _HEADER.size, deadline)
            exchange, tag_len, payload_len = _HEADER.unpack(header)
            body = _read_exact(sock, tag_len + payload_len, deadline)
        except _Lost as e:
            raise self._lost(peer, n, tag, e.reason) from None
        if exchange != n:
            raise DivergenceError(
                n, f"process {peer} sent exchange {exchange} while process {self.process_id} is at exchange {n}"
            )
        return body[:tag_len].decode(), body[tag_len:], header + body

    def _send(self, peer: int, data: bytes, n: int, tag: str, deadline: float) -> None:
        sock = self.peers[peer]
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.sendall(data)
        except OSError as e:
            raise self._lost(peer, n, tag, f"sending failed: {e}") from None

    def _lost(self, peer: int, n: int, tag: str, reason: str) -> ProcessLostError:
        return ProcessLostError(
            peer,
            f"process {peer} sent nothing for exchange {n} ({tag!r}) within {self.timeout_s:g} s: it died, hung or "
            f"stopped serving; process {self.process_id} stops ({reason})",
        )


def _frame(n: int, tag: str, payload: bytes) -> bytes:
    encoded = tag.encode()
    return _HEADER.pack(n, len(encoded), len(payload)) + encoded + payload


def _read_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes from ``sock`` before ``deadline`` (``time.monotonic()``); ``_Lost`` when the
    connection closed, failed or the deadline passed."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Lost("timed out")
        try:
            sock.settimeout(remaining)
            count = sock.recv_into(view[got:])
        except TimeoutError:
            raise _Lost("timed out") from None
        except OSError as e:
            raise _Lost(f"connection failed: {e}") from None
        if count == 0:
            raise _Lost("its connection closed")
        got += count
    return bytes(buf)


def reachable_host(coordinator_address: str | None) -> str:
    """This host's address on the route to the coordinator (``host:port``), which every process
    reaches: the coordinator is process 0's; without one, the address of this host's name."""
    if not coordinator_address:
        return socket.gethostbyname(socket.gethostname())
    host = coordinator_address.rpartition(":")[0].strip("[]") or coordinator_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 1))  # no packet is sent: only the route is chosen
        return str(probe.getsockname()[0])
