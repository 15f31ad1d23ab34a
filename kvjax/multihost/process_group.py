"""`initialize`: join this process to a multi-process run (``jax.distributed``), and `ProcessGroup`,
what the serving code needs to know of it afterwards.

As on a TPU pod, where every host runs the same program and JAX finds the coordinator, the
process count and this process's id itself, every field of `ProcessFlags` may be None: JAX's
cluster detection fills it in. On one machine (the launcher, the tests) they are given: process
0 hosts the coordinator at ``coordinator_address``; ``cpu_devices`` splits each process's CPU into
that many devices, and CPU collectives between processes go through gloo.

Faults are bounded by ``timeout_s`` (seconds): joining (an unreachable coordinator is one
`CoordinatorError` naming the address; JAX itself would abort the process), every exchange of
the serving loop (``SocketChannel``: direct connections to process 0, found through the
coordination service; ``transport="kv"``: ``ProcessChannel``, through its key-value store),
and JAX's heartbeat, which ends every process of the group when one of them dies (twice the
timeout, at least ``MIN_HEARTBEAT_S``, so that a process waiting in an exchange names the silent
process first; JAX's own message names the task it lost).

Authentication: a group of several processes needs the same ``ClusterSecret`` in each
(``ProcessFlags.secret``, else the environment's ``KVJAX_CLUSTER_SECRET``; ``python -m kvjax
launch`` sets it for the processes it starts). Without one ``initialize`` refuses before it
contacts anything (``MissingSecretError``); with one, every peer of the channel is authenticated
and every frame sealed (``socket_channel``, ``channel``).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from kvjax.multihost.agreement import ProcessAgreement
from kvjax.multihost.channel import DEFAULT_TIMEOUT_S, Channel, ProcessChannel
from kvjax.multihost.cluster_secret import ClusterSecret, SecretLike
from kvjax.multihost.errors import CoordinatorError
from kvjax.multihost.socket_channel import SocketChannel

__all__ = ["ProcessFlags", "ProcessGroup", "initialize"]

#: JAX's heartbeat never times out sooner (seconds): a loaded host may miss a few beats.
MIN_HEARTBEAT_S = 10
#: How the serving loop's exchanges travel (``ProcessFlags.transport``).
TRANSPORTS = ("socket", "kv")


@dataclass(frozen=True)
class ProcessFlags:
    """How to join the group; None lets JAX detect the value (a TPU pod).

    ``coordinator_address``: ``host:port`` of process 0's coordination service;
    ``num_processes`` and ``process_id``: the group's size and this process's place in it;
    ``cpu_devices``: CPU devices per process (None: the platform's own); ``timeout_s``: the
    bound of every wait (seconds); ``check_agreement``: compare every process's state digest at
    every step (``kvjax.multihost.digest``); ``join_timeout_s``: the bound on joining (reaching
    the coordinator, every process registering), when it differs from ``timeout_s``;
    ``secret``: the group's ``ClusterSecret`` (or its bytes or hex text; None: the environment's
    ``KVJAX_CLUSTER_SECRET``), never shown in the flags' repr.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    cpu_devices: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    check_agreement: bool = False
    join_timeout_s: float | None = None
    transport: str = "socket"
    secret: SecretLike | None = field(default=None, repr=False, compare=False)

    @property
    def join_bound_s(self) -> float:
        """The bound on joining the group (seconds): ``join_timeout_s``, else ``timeout_s``."""
        return self.timeout_s if self.join_timeout_s is None else self.join_timeout_s

    def __post_init__(self) -> None:
        n, i = self.num_processes, self.process_id
        if n is not None and n < 1:
            raise CoordinatorError(f"num_processes {n}: give 1 or more processes")
        if n is not None and i is not None and not 0 <= i < n:
            raise CoordinatorError(f"process_id {i}: with {n} processes give an id from 0 to {n - 1}")
        if self.timeout_s <= 0:
            raise CoordinatorError(f"timeout {self.timeout_s} s: give a positive number of seconds")
        if self.transport not in TRANSPORTS:
            raise CoordinatorError(f"transport {self.transport!r}: give one of {list(TRANSPORTS)}")


@dataclass
class ProcessGroup:
    """This process's place in a joined group, and the channel every process exchanges through."""

    process_id: int
    num_processes: int
    channel: Channel
    check_agreement: bool = False
    digest_checks: int = 0  # state digests compared so far (all equal), with check_agreement

    def agreement(self) -> ProcessAgreement:
        """A MIN agreement over the group's channel (one per scheduler)."""
        return ProcessAgreement(self.channel)


def initialize(flags: ProcessFlags) -> ProcessGroup:
    """Join the group (``jax.distributed.initialize``) and return it. Call before any other jax
    use in the process.

    Raises:
        MissingSecretError: the group may have several processes and no secret was given
            (``flags.secret`` or ``KVJAX_CLUSTER_SECRET``); nothing was contacted.
        CoordinatorError: the coordinator did not answer within ``flags.timeout_s`` (probed
            before JAX joins, which would abort the process instead of raising).
        AuthenticationError: process 0's rendezvous answer failed authentication (the
            processes' secrets differ).
    """
    secret = None if flags.num_processes == 1 else ClusterSecret.resolve(flags.secret)
    if flags.coordinator_address is not None and flags.process_id not in (None, 0):
        wait_for_coordinator(flags.coordinator_address, flags.join_bound_s)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if flags.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", flags.cpu_devices)
    timeout = max(1, round(flags.timeout_s))
    jax.distributed.initialize(
        coordinator_address=flags.coordinator_address,
        num_processes=flags.num_processes,
        process_id=flags.process_id,
        initialization_timeout=max(1, round(flags.join_bound_s)),
        heartbeat_timeout_seconds=max(2 * timeout, MIN_HEARTBEAT_S),
        shutdown_timeout_seconds=timeout,
    )
    channel: Channel
    if flags.transport == "kv":
        channel = ProcessChannel.from_jax(secret=secret, timeout_s=flags.timeout_s)
    else:
        channel = SocketChannel.from_jax(secret=secret, timeout_s=flags.timeout_s, join_timeout_s=flags.join_bound_s)
    return ProcessGroup(jax.process_index(), jax.process_count(), channel, flags.check_agreement)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Return once ``address`` (``host:port``) accepts a TCP connection; `CoordinatorError`
    naming it when it has not within ``timeout_s`` seconds."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise CoordinatorError(f"coordinator address {address!r}: give it as HOST:PORT (e.g. 10.0.0.1:1234)")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(1.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise CoordinatorError(
                    f"the coordinator at {address} did not answer within {timeout_s:g} s ({e.strerror or e}); "
                    "process 0 hosts it: start it, or check the coordinator address and port"
                ) from None
            time.sleep(0.2)
