"""Lockstep DP serving checked after every round: each rank's memory balance.

``BalancedFront`` wraps a ``LockstepDPScheduler`` (``submit``, ``step``, ``idle``, ``run``,
``leak_free`` as the front's) and asserts after every round, on every rank, what
``Scheduler.live_requests`` promises: ``available + evictable + protected + held by live
requests == capacity`` (a live request holds its pages ``[cache_protected_len, kv_len())``,
page-rounded; with overlap this includes a speculative step's slot until the request is found
finished, and with a speculative proposer its ``allocated_len``: up to the reserve of the round in
flight) and every request-table row free or held by a live request. A rank that frees sliding
windows (``SWAServing``) is not counted so (its requests hold less than that range); its leaks
are checked when it is idle (``leak_free``).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvjax.dp.lockstep import LockstepDPScheduler
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.serving_front import serve_to_completion
from kvjax.serve.swa_extension import SWAServing


def assert_balanced(sched: Scheduler, rank: int) -> None:
    """One rank's balance (module docstring); the error names the rank and the terms. Nothing
    for a rank that frees sliding windows."""
    if any(isinstance(e, SWAServing) for e in sched.extensions):
        return
    ps = sched.page_size
    live = sched.live_requests()
    allocated = getattr(sched.proposer, "allocated_len", ServingReq.kv_len)
    held = sum(-(-allocated(r) // ps) * ps - r.cache_protected_len for r in live if r.req_pool_idx is not None)
    tree = sched.tree
    terms = (sched.alloc.available_size(), tree.evictable_size(), tree.protected_size(), held)
    capacity = sched.alloc.size
    assert sum(terms) == capacity, f"rank {rank}: available, evictable, protected, held {terms} != {capacity}"
    rows = sched.rows.available_size() + sum(r.req_pool_idx is not None for r in live)
    assert rows == sched.rows.size, f"rank {rank}: {rows} rows free or held != {sched.rows.size}"


class BalancedFront:
    """A lockstep front whose every round is followed by every rank's balance check; ``rounds``
    counts the rounds checked."""

    def __init__(self, front: LockstepDPScheduler) -> None:
        self.front = front
        self.rounds = 0

    @property
    def idle(self) -> bool:
        return self.front.idle

    @property
    def finished(self) -> list[ServingReq]:
        return self.front.finished

    def submit(self, reqs: Iterable[ServingReq]) -> None:
        self.front.submit(reqs)

    def step(self) -> list[ServingReq]:
        done = self.front.step()
        for rank, sched in enumerate(self.front.schedulers):
            assert_balanced(sched, rank)
        self.rounds += 1
        return done

    def run(self, reqs: Iterable[ServingReq] = ()) -> list[ServingReq]:
        return serve_to_completion(self, reqs)

    def leak_free(self) -> bool:
        return self.front.leak_free()
