"""The errors of multi-process serving: a process that stopped answering, processes whose state
diverged, a group that could not form, and a peer or frame that failed authentication. Each stops
the run on the process that raises it; the message names the other process (or the address of
the connection) and what it was waiting for (or what differs)."""

from __future__ import annotations

__all__ = ["AuthenticationError", "CoordinatorError", "DivergenceError", "ProcessLostError"]


class ProcessLostError(RuntimeError):
    """Another process sent nothing within the bounded wait (it died, hung or stopped serving).

    Attributes:
        process_id: the silent process.
    """

    def __init__(self, process_id: int, message: str) -> None:
        super().__init__(message)
        self.process_id = process_id


class DivergenceError(RuntimeError):
    """Two processes' serving state differs at a step: their trees, allocators or request tables
    would write different slots of one sharded pool. ``step`` is the first step found divergent."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


class CoordinatorError(RuntimeError):
    """The processes could not form their group: the coordinator was unreachable within the
    initialization timeout, or the group's flags are inconsistent."""


class AuthenticationError(CoordinatorError):
    """A peer or a frame failed authentication against the group's secret
    (``kvjax.multihost.cluster_secret``): process 0's rendezvous answer did not prove it holds the
    secret, or a frame of an exchange was altered, replayed or not sealed with the group's key.
    The connection it came over is closed; nothing it carried is used.

    Attributes:
        peer: who sent it: ``"process Q"`` or the connection's address (``host:port``).
    """

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer
