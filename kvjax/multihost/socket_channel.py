"""`SocketChannel`: the serving loop's exchanges over direct TCP connections between process 0 and
every other process (a star), found once through the coordination service, every peer
authenticated and every frame sealed, each wait bounded.

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

Frame: ``<exchange u64><tag length u32><payload length u32><tag utf-8><payload><tag MAC>``,
little endian; the MAC (``frame_auth``, 32 bytes) seals the frame with the connection's key, its
direction and its place in that direction's sequence, so a frame altered, replayed or not sealed
by the peer is refused: the connection is closed, logged with its address and process, and an
``AuthenticationError`` stops the run. Process 0 reseals each frame it relays for the
connection it goes out on. Payloads are opaque bytes; what the serving loop sends in them is
``wire``'s typed messages, never a pickle.

Rendezvous (``connect``): process 0 listens on the address its host reaches the coordinator from
(``reachable_host``), posts ``host:port`` under ``<namespace>/socket`` in the coordination
service's key-value store, and accepts connections until one from each other process passed the
challenge-response of ``handshake`` (both ends prove they hold the group's ``ClusterSecret``,
fresh nonces on each side). A connection that fails it (not a hello, a wrong or replayed proof,
an id out of range or taken, silence) is closed and logged with its address (logger
``kvjax.multihost``), never served, and process 0 goes on waiting for the real peers. Every step
is bounded by the join timeout; process 0 deletes the key afterwards.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Mapping

from kvjax.multihost.channel import DEFAULT_TIMEOUT_S, KeyValueClient
from kvjax.multihost.cluster_secret import ClusterSecret, SecretLike
from kvjax.multihost.errors import AuthenticationError, DivergenceError, ProcessLostError
from kvjax.multihost.frame_auth import MAC_SIZE, FrameOpener, FrameSealer
from kvjax.multihost.handshake import HANDSHAKE_TIMEOUT_S, Refused, accept_peer, join_process_zero
from kvjax.multihost.socket_io import ConnectionLost, read_exact, send_all

__all__ = ["SocketChannel", "reachable_host"]

logger = logging.getLogger("kvjax.multihost")

_HEADER = struct.Struct("<QII")


class SocketChannel:
    """Exchanges between ``num_processes`` processes over ``peers`` (module docstring).

    Args:
        peers: the open connections: on process 0, one per other process (by process id); on
            any other process, ``{0: connection to process 0}``.
        keys: each connection's frame key (the handshake's; both ends hold the same), by the
            same process ids as ``peers``.
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
        keys: Mapping[int, bytes],
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
        if set(keys) != set(peers):
            raise ValueError(f"keys for processes {sorted(keys)} where the connections are to {sorted(peers)}")
        self.process_id = process_id
        self.num_processes = num_processes
        self.timeout_s = float(timeout_s)
        self.peers = dict(peers)
        self._sealers = {q: FrameSealer(k, process_id, q) for q, k in keys.items()}
        self._openers = {q: FrameOpener(k, q, process_id) for q, k in keys.items()}
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
        secret: SecretLike | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        join_timeout_s: float | None = None,
        namespace: str = "kvjax",
    ) -> SocketChannel:
        """Open the star of authenticated connections (module docstring). ``host``: the address
        process 0 listens on (the others ignore it); ``secret``: the group's (None: the
        environment's ``KVJAX_CLUSTER_SECRET``; ``cluster_secret``).

        Raises:
            MissingSecretError: several processes and no secret.
            ProcessLostError: a process did not connect (or process 0 did not answer) within
                ``join_timeout_s`` (default ``timeout_s``), named.
            AuthenticationError: on a process other than 0, process 0's answer failed
                authentication (the secrets differ).
        """
        bound = timeout_s if join_timeout_s is None else join_timeout_s
        if num_processes == 1:
            return cls({}, process_id, num_processes, keys={}, timeout_s=timeout_s)
        group_secret = ClusterSecret.resolve(secret)
        deadline = time.monotonic() + bound
        key = f"{namespace}/socket"
        if process_id == 0:
            peers, keys = _serve_rendezvous(client, key, group_secret, num_processes, host, deadline, bound)
            client.key_value_delete(key)
            return cls(peers, process_id, num_processes, keys=keys, timeout_s=timeout_s)
        try:
            address = client.blocking_key_value_get_bytes(key, int(bound * 1000)).decode()
        except Exception as e:  # noqa: BLE001  deadline exceeded, or the coordinator is gone
            raise ProcessLostError(
                0, f"process 0 posted no address within {bound:g} s ({str(e).splitlines()[0] if str(e) else e})"
            ) from None
        addr_host, _, port = address.rpartition(":")
        try:
            conn = socket.create_connection((addr_host, int(port)), timeout=max(deadline - time.monotonic(), 1e-3))
        except OSError as e:
            raise ProcessLostError(
                0, f"process {process_id} could not connect to process 0 at {address}: {e}"
            ) from None
        try:
            frame_key = join_process_zero(conn, group_secret, process_id, address, deadline)
        except AuthenticationError:
            conn.close()
            raise
        except ConnectionLost as e:
            conn.close()
            raise ProcessLostError(
                0,
                f"process 0 at {address} did not accept process {process_id} within {bound:g} s ({e.reason}); it "
                "refused this process (see its log) or stopped",
            ) from None
        return cls({0: conn}, process_id, num_processes, keys={0: frame_key}, timeout_s=timeout_s)

    @classmethod
    def from_jax(
        cls,
        *,
        secret: SecretLike | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        join_timeout_s: float | None = None,
        namespace: str = "kvjax",
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
            secret=secret,
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
            AuthenticationError: a frame failed authentication (its connection is closed).
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
            for q in range(1, self.num_processes):
                sealer = self._sealers[q]
                self._send(q, b"".join(f + sealer.seal(f) for f in raw), n, tag, deadline)
        else:
            self._send(0, mine + self._sealers[0].seal(mine), n, tag, deadline)
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

    def _receive(self, peer: int, n: int, tag: str, deadline: float) -> tuple[str, bytes, bytes]:
        """One authenticated frame from ``peer`` (the connection to process 0 on the others): its
        tag, payload and bytes without the MAC. The frame's sender is ``peer`` on process 0;
        elsewhere any process (relayed)."""
        sock = self.peers[peer]
        try:
            header = read_exact(sock, _HEADER.size, deadline)
            exchange, tag_len, payload_len = _HEADER.unpack(header)
            rest = read_exact(sock, tag_len + payload_len + MAC_SIZE, deadline)
        except ConnectionLost as e:
            raise self._lost(peer, n, tag, e.reason) from None
        body, mac = rest[:-MAC_SIZE], rest[-MAC_SIZE:]
        if not self._openers[peer].verify(mac, header, body):
            address = _address(sock)
            sock.close()
            reason = (
                f"a frame from process {peer} ({address}) at exchange {n} ({tag!r}) failed authentication: altered, "
                f"replayed or not sealed with the group's key; process {self.process_id} closed the connection"
            )
            logger.warning("%s", reason)
            raise AuthenticationError(f"process {peer}", reason)
        if exchange != n:
            raise DivergenceError(
                n, f"process {peer} sent exchange {exchange} while process {self.process_id} is at exchange {n}"
            )
        try:
            their_tag = body[:tag_len].decode()
        except UnicodeDecodeError:
            raise DivergenceError(n, f"process {peer} sent a tag that is not UTF-8 at exchange {n}") from None
        return their_tag, body[tag_len:], header + body

    def _send(self, peer: int, data: bytes, n: int, tag: str, deadline: float) -> None:
        try:
            send_all(self.peers[peer], data, deadline)
        except ConnectionLost as e:
            raise self._lost(peer, n, tag, e.reason) from None

    def _lost(self, peer: int, n: int, tag: str, reason: str) -> ProcessLostError:
        return ProcessLostError(
            peer,
            f"process {peer} sent nothing for exchange {n} ({tag!r}) within {self.timeout_s:g} s: it died, hung or "
            f"stopped serving; process {self.process_id} stops ({reason})",
        )


def _serve_rendezvous(
    client: KeyValueClient,
    key: str,
    secret: ClusterSecret,
    num_processes: int,
    host: str,
    deadline: float,
    bound: float,
) -> tuple[dict[int, socket.socket], dict[int, bytes]]:
    """Process 0's side of the rendezvous (module docstring): the accepted connections and their
    frame keys, by process id. Refused connections are closed and logged; the wait goes on until
    ``deadline``, then ``ProcessLostError`` names the processes missing (and the refusals)."""
    peers: dict[int, socket.socket] = {}
    keys: dict[int, bytes] = {}
    refused: list[str] = []
    try:
        with socket.create_server((host, 0)) as server:
            client.key_value_set_bytes(key, f"{host}:{server.getsockname()[1]}".encode())
            while len(peers) < num_processes - 1:
                try:
                    server.settimeout(max(deadline - time.monotonic(), 1e-3))
                    conn, where = server.accept()
                except OSError:
                    missing = sorted(set(range(1, num_processes)) - set(peers))
                    also = f"; refused {len(refused)} connection(s) from {', '.join(refused)}" if refused else ""
                    raise ProcessLostError(
                        missing[0],
                        f"processes {missing} did not connect to process 0 within {bound:g} s; they died or cannot "
                        f"reach its address{also}",
                    ) from None
                address = _format_address(where)
                try:
                    handshake_deadline = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S)
                    peer, frame_key = accept_peer(conn, secret, num_processes, peers, handshake_deadline)
                except Refused as e:
                    conn.close()
                    refused.append(address)
                    logger.warning(
                        "process 0 refused the connection from %s during the rendezvous and closed it: %s",
                        address,
                        e.reason,
                    )
                    continue
                peers[peer] = conn
                keys[peer] = frame_key
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    return peers, keys


def _format_address(where: object) -> str:
    """``host:port`` of a socket address (``([host], port, ...)``), else its text."""
    if isinstance(where, tuple) and len(where) >= 2:
        return f"{where[0]}:{where[1]}"
    return str(where) or "a local socket"


def _address(sock: socket.socket) -> str:
    try:
        return _format_address(sock.getpeername())
    except OSError:
        return "a closed connection"


def _frame(n: int, tag: str, payload: bytes) -> bytes:
    encoded = tag.encode()
    return _HEADER.pack(n, len(encoded), len(payload)) + encoded + payload


def reachable_host(coordinator_address: str | None) -> str:
    """This host's address on the route to the coordinator (``host:port``), which every process
    reaches: the coordinator is process 0's; without one, the address of this host's name."""
    if not coordinator_address:
        return socket.gethostbyname(socket.gethostname())
    host = coordinator_address.rpartition(":")[0].strip("[]") or coordinator_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 1))  # no packet is sent: only the route is chosen
        return str(probe.getsockname()[0])
