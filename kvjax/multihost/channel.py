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
length (pickled requests) without a compile per shape, and every wait has a deadline, so a
process that died or hung is named in one error within ``timeout_s`` instead of a collective
that never returns (gloo on CPU, DCN on a pod).

Invariants: every process makes the same exchanges in the same order (the serving loop is the
same program everywhere); exchange ``n``'s tag is checked against the other processes', so a
program that diverged stops with both tags named. Keys are grouped in blocks of
``DELETE_BLOCK`` exchanges per process; once exchange ``n`` is complete every process has posted
``n``, so has read every key before it, and a process that completes the first exchange of a
block deletes its own previous block in one call (the store holds at most two blocks per
process; one delete per block rather than per exchange keeps the exchange at two calls).
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

from kvjax.multihost.errors import DivergenceError, ProcessLostError

__all__ = ["Channel", "KeyValueClient", "LoopbackChannel", "ProcessChannel"]

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
    process's ``LoopbackChannel``. ``exchanges``: exchanges completed, equal on every process."""

    process_id: int
    num_processes: int
    exchanges: int

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]: ...

    def broadcast(self, tag: str, payload: bytes = b"") -> bytes: ...

    def all_gather_object(self, tag: str, value: Any) -> list[Any]: ...


class ProcessChannel:
    """Exchanges between ``num_processes`` processes (this one is ``process_id``); module docstring.

    Args:
        client: the coordination service's client (``ProcessChannel.from_jax()`` takes jax's).
        timeout_s: the longest wait for another process's message, in seconds.
        namespace: the keys' prefix (several channels in one run need different ones).
    """

    def __init__(
        self,
        client: KeyValueClient,
        process_id: int,
        num_processes: int,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        namespace: str = "kvjax",
    ) -> None:
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} is not in [0, {num_processes}); give 0 to num_processes - 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s {timeout_s} must be positive (seconds)")
        self.client = client
        self.process_id = process_id
        self.num_processes = num_processes
        self.timeout_s = float(timeout_s)
        self.namespace = namespace
        self.exchanges = 0  # exchanges completed

    @classmethod
    def from_jax(cls, *, timeout_s: float = DEFAULT_TIMEOUT_S, namespace: str = "kvjax") -> ProcessChannel:
        """The channel of the running ``jax.distributed`` group (``kvjax.multihost.initialize``
        first). Raises RuntimeError when jax.distributed is not initialized."""
        import jax
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialized: call kvjax.multihost.initialize first")
        return cls(client, jax.process_index(), jax.process_count(), timeout_s=timeout_s, namespace=namespace)

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
        self.client.key_value_set_bytes(self._key(n, self.process_id), pickle.dumps((tag, payload)))
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
            their_tag, their_payload = pickle.loads(raw)
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

    def broadcast(self, tag: str, payload: bytes = b"") -> bytes:
        """Process 0's ``payload`` on every process (the others' ``payload`` is ignored)."""
        return self.all_gather(tag, payload if self.process_id == 0 else b"")[0]

    def all_gather_object(self, tag: str, value: Any) -> list[Any]:
        """``all_gather`` of a picklable value."""
        return [pickle.loads(b) for b in self.all_gather(tag, pickle.dumps(value))]


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

    def all_gather_object(self, tag: str, value: Any) -> list[Any]:
        return [pickle.loads(b) for b in self.all_gather(tag, pickle.dumps(value))]
