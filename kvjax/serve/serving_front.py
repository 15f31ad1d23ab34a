"""`ServingFront`: what a serving loop drives, and `serve_to_completion`, the loop itself.

A ``kvjax.serve.scheduler.Scheduler`` is one; so is a DP front of one scheduler per rank
(``kvjax.dp.DPScheduler``, ``kvjax.dp.LockstepDPScheduler``). Anything with this interface runs
under ``serve_to_completion`` and ``kvjax.serve.workload.run_workload``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvjax.serve.serving_req import ServingReq

__all__ = ["ServingFront", "serve_to_completion"]


class ServingFront(Protocol):
    """Queues requests and serves them a step at a time.

    Attributes:
        finished: every request that has finished, in finishing order.
    """

    finished: list[ServingReq]

    @property
    def idle(self) -> bool:
        """Whether no request is queued, running or in flight."""
        ...

    def submit(self, reqs: Iterable[ServingReq]) -> None:
        """Queue requests (all or none: a request that can never be served raises first)."""
        ...

    def step(self) -> list[ServingReq]:
        """Serve one step; the requests that finished in it."""
        ...


def serve_to_completion(front: ServingFront, reqs: Iterable[ServingReq] = ()) -> list[ServingReq]:
    """Submit ``reqs`` to ``front`` and step it until idle; ``front.finished`` (every request it has
    finished, this call's and earlier ones', in finishing order)."""
    front.submit(reqs)
    while not front.idle:
        front.step()
    return front.finished
