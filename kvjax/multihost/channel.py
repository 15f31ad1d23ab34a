"""`ProcessChannel`: byte messages exchanged by every process of a ``jax.distributed`` run, through
the coordination service's key-value store, each wait bounded.

One primitive, ``all_gather(tag, payload) -> [payload of process 0, 1, ...]``: every process posts
its payload under the exchange's sequence number and reads every other's. A broadcast from
process 0 is an all-gather in which the others post an empty payload; posting keeps every
process at most one exchange ahead of the slowest, and lets each side notice the other is gone.

The serving loop's default transport is ``socket_channel.SocketChannel`` (the same primitive
over direct connections, several times faster per exchange); this one needs no port beyond the
coordinator's (``ProcessFlags(transport="kv")``).

Why the key-value store and not a device collective (``multihost_utils``): messages are of any
length (encoded requests) without a compile per shape, and every wait has a deadline, so a
process that died or hung is named in one error within ``timeout_s`` instead of a collective
that never returns (gloo on CPU, DCN on a pod).

Invariants: every process makes the same exchanges in the same order (the serving loop is the
same program everywhere); exchange ``n``'s tag is checked against the other processes', so a
program that diverged stops with both tags named. Keys are grouped in blocks of
``DELETE_BLOCK`` exchanges per process; once exchange ``n`` is complete every process has posted
``n``, so has read every key before it, and a process that completes the first exchange of a
block deletes its own previous block in one call (the store holds at most two blocks per
process; one delete per block rather than per exchange keeps the exchange at two calls).

Authentication: anyone who reaches the coordinator can write its store, so every value is
``<exchange u64><sender u32><tag length u32><tag><payload><MAC>``, the MAC (``frame_auth``)
sealing it with a key derived from the group's ``ClusterSecret``, the namespace and a session
nonce process 0 posts once per run (``from_jax``; signed), at its place (sender, exchange): a
value forged, altered, moved to another key or replayed from another run fails, and the reader
raises ``AuthenticationError`` naming the key. Payloads are opaque bytes; typed values travel as
``wire`` messages (`all_gather_message`), never pickled.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from typing import Protocol, TypeVar

from kvjax.multihost import wire
from kvjax.multihost.cluster_secret import ClusterSecret, SecretLike
from kvjax.multihost.errors import AuthenticationError, DivergenceError, ProcessLostError
from kvjax.multihost.frame_auth import BROADCAST, MAC_SIZE, FrameOpener, FrameSealer, derive_key

__all__ = ["Channel", "KeyValueClient", "LoopbackChannel", "ProcessChannel", "agree_session", "all_gather_message"]

M = TypeVar("M")
_HEADER = struct.Struct("<QII")  # exchange, sender, tag length
SESSION_SIZE = 32

DEFAULT_TIMEOUT_S = 60.0
#: Exchanges per block of keys deleted together (module docstring).
DELETE_BLOCK = 64


class KeyValueClient(Protocol):
    """The part of jax's ``DistributedRuntimeClient`` the channel uses."""

    def key_value_set_bytes(self, key: str, value: bytes) -> None: ...

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes: ...

    def key_value_delete(self, key: str) -> None: ...


class Channel(Protocol):
    """What the serving loop exchanges through: this class's key-value store transport, the
    direct connections of ``socket_channel.SocketChannel`` (what ``initialize`` opens), or one
    process's ``LoopbackChannel``. ``exchanges``: exchanges completed, equal on every process.
    Bytes only: typed values go through `all_gather_message`."""

    process_id: int
    num_processes: int
    exchanges: int

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]: ...

    def broadcast(self, tag: str, payload: bytes = b"") -> bytes: ...


def all_gather_message(channel: Channel, tag: str, message: M) -> list[M]:
    """``all_gather`` of a typed message (``wire``: a ``@wire_message`` instance): every
    process's, in process order, each decoded as ``message``'s type.

    Raises:
        TypeError: ``message`` is not of a declared message type (nothing is sent).
        WireError: ``message`` cannot travel (nothing is sent), or a process's bytes are not
            a valid message of that type and version (named).
    """
    cls = type(message)
    gathered = channel.all_gather(tag, wire.encode(message))
    out = []
    for q, raw in enumerate(gathered):
        try:
            out.append(wire.decode(raw, cls))
        except wire.WireError as e:
            raise wire.WireError(e.where, f"from process {q} ({tag!r}): {str(e).partition(': ')[2]}") from None
    return out


class ProcessChannel:
    """Exchanges between ``num_processes`` processes (this one is ``process_id``); module docstring.

    Args:
        client: the coordination service's client (``ProcessChannel.from_jax()`` takes jax's).
        secret: the group's (None: the environment's ``KVJAX_CLUSTER_SECRET``; required with
            several processes, ``cluster_secret``).
        session: this run's session nonce (``agree_session``; the same on every process), so
            values of another run under the same secret fail authentication.
        timeout_s: the longest wait for another process's message, in seconds.
        namespace: the keys' prefix (several channels in one run need different ones).
    """

    def __init__(
        self,
        client: KeyValueClient,
        process_id: int,
        num_processes: int,
        *,
        secret: SecretLike | None = None,
        session: bytes = b"",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        namespace: str = "kvjax",
    ) -> None:
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} is not in [0, {num_processes}); give 0 to num_processes - 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s {timeout_s} must be positive (seconds)")
        # One process reads only its own values: a key of its own suffices.
        group_secret = ClusterSecret.resolve(secret) if num_processes > 1 else ClusterSecret.generate()
        self.client = client
        self.process_id = process_id
        self.num_processes = num_processes
        self.timeout_s = float(timeout_s)
        self.namespace = namespace
        self.exchanges = 0  # exchanges completed
        key = derive_key(group_secret, b"kv channel", namespace.encode(), session)
        self._sealer = FrameSealer(key, process_id, BROADCAST)
        self._openers = [FrameOpener(key, q, BROADCAST) for q in range(num_processes)]

    @classmethod
    def from_jax(
        cls, *, secret: SecretLike | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, namespace: str = "kvjax"
    ) -> ProcessChannel:
        """The channel of the running ``jax.distributed`` group (``kvjax.multihost.initialize``
        first), its session agreed (``agree_session``). Raises RuntimeError when
        jax.distributed is not initialized."""
        import jax
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialized: call kvjax.multihost.initialize first")
        process_id, num_processes = jax.process_index(), jax.process_count()
        group_secret = ClusterSecret.resolve(secret) if num_processes > 1 else ClusterSecret.generate()
        session = agree_session(client, process_id, group_secret, timeout_s=timeout_s, namespace=namespace)
        return cls(
            client,
            process_id,
            num_processes,
            secret=group_secret,
            session=session,
            timeout_s=timeout_s,
            namespace=namespace,
        )

    def _block(self, process: int, block: int) -> str:
        return f"{self.namespace}/{process}/{block}"

    def _key(self, exchange: int, process: int) -> str:
        return f"{self._block(process, exchange // DELETE_BLOCK)}/{exchange}"

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]:
        """Post ``payload`` for this exchange and return every process's, in process order.

        Raises:
            ProcessLostError: a process posted nothing within ``timeout_s`` (named, with the tag).
            DivergenceError: a process posted under another tag (the programs diverged).
        """
        n = self.exchanges
        if self._sealer.sequence != n:
            raise RuntimeError(f"exchange {n} after a failed exchange: this channel is broken, make a new one")
        encoded = tag.encode()
        value = _HEADER.pack(n, self.process_id, len(encoded)) + encoded + payload
        self.client.key_value_set_bytes(self._key(n, self.process_id), value + self._sealer.seal(value))
        out: list[bytes] = []
        for q in range(self.num_processes):
            if q == self.process_id:
                out.append(payload)
                continue
            try:
                raw = self.client.blocking_key_value_get_bytes(self._key(n, q), int(self.timeout_s * 1000))
            except Exception as e:  # noqa: BLE001  deadline exceeded, or the coordinator is gone
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ProcessLostError(
                    q,
                    f"process {q} sent nothing for exchange {n} ({tag!r}) within {self.timeout_s:g} s: it died, hung "
                    f"or stopped serving; process {self.process_id} stops ({reason})",
                ) from None
            their_tag, their_payload = self._open(q, n, raw)
            if their_tag != tag:
                raise DivergenceError(
                    n,
                    f"exchange {n}: process {q} sent {their_tag!r} where process {self.process_id} sent {tag!r}; "
                    "the processes' serving loops diverged",
                )
            out.append(their_payload)
        if n % DELETE_BLOCK == 0 and n > 0:  # every key before n is read: drop the previous block
            self.client.key_value_delete(self._block(self.process_id, n // DELETE_BLOCK - 1))
        self.exchanges = n + 1
        return out

    def _open(self, q: int, n: int, raw: bytes) -> tuple[str, bytes]:
        """The tag and payload of process ``q``'s value for exchange ``n``, once its MAC verifies
        at that place; ``AuthenticationError`` naming the key otherwise."""
        body, mac = raw[:-MAC_SIZE], raw[-MAC_SIZE:]
        if len(raw) < _HEADER.size + MAC_SIZE or not self._openers[q].verify_at(n, mac, body):
            raise AuthenticationError(
                f"process {q}",
                f"the value under {self._key(n, q)!r} (process {q}, exchange {n}) failed authentication: written by "
                "someone without the cluster secret, altered, or replayed from another key or run; process "
                f"{self.process_id} stops",
            )
        _, _, tag_len = _HEADER.unpack_from(body)
        their_tag = body[_HEADER.size : _HEADER.size + tag_len].decode()
        return their_tag, body[_HEADER.size + tag_len :]

    def broadcast(self, tag: str, payload: bytes = b"") -> bytes:
        """Process 0's ``payload`` on every process (the others' ``payload`` is ignored)."""
        return self.all_gather(tag, payload if self.process_id == 0 else b"")[0]


def agree_session(
    client: KeyValueClient,
    process_id: int,
    secret: ClusterSecret,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    namespace: str = "kvjax",
) -> bytes:
    """This run's session nonce: process 0 draws ``SESSION_SIZE`` random bytes and posts them,
    with their HMAC under ``secret``, at ``<namespace>/session``; every other process reads and
    verifies them (bounded by ``timeout_s``).

    Raises:
        ProcessLostError: process 0 posted nothing within ``timeout_s``.
        AuthenticationError: the posted session fails authentication (the secrets differ, or
            someone else wrote it).
    """
    key = f"{namespace}/session"
    mac_key = derive_key(secret, b"kv session", namespace.encode())
    if process_id == 0:
        nonce = secrets.token_bytes(SESSION_SIZE)
        client.key_value_set_bytes(key, nonce + hmac.digest(mac_key, nonce, "sha256"))
        return nonce
    try:
        raw = client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001  deadline exceeded, or the coordinator is gone
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ProcessLostError(0, f"process 0 posted no session within {timeout_s:g} s ({reason})") from None
    nonce, mac = raw[:SESSION_SIZE], raw[SESSION_SIZE:]
    if len(raw) != SESSION_SIZE + MAC_SIZE or not hmac.compare_digest(mac, hmac.digest(mac_key, nonce, "sha256")):
        raise AuthenticationError(
            "process 0",
            f"the session posted under {key!r} failed authentication: process {process_id}'s cluster secret differs "
            "from process 0's (give every process the same KVJAX_CLUSTER_SECRET), or someone else wrote it",
        )
    return nonce


class LoopbackChannel:
    """A channel of one process (``num_processes`` 1): every exchange returns this process's
    payload. What single-process code uses where a channel is expected."""

    process_id = 0
    num_processes = 1

    def __init__(self) -> None:
        self.exchanges = 0

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]:
        self.exchanges += 1
        return [payload]

    def broadcast(self, tag: str, payload: bytes = b"") -> bytes:
        return self.all_gather(tag, payload)[0]
