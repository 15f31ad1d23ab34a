"""`Agreement`: the values every process must take the same before they change a tree or an
allocator, agreed as SGLang's HiCache controller does (an all-reduce with MIN).

Asynchronous host work (host-tier backups and load-backs, storage prefetches) finishes at
different times on different processes. Each process reports what it sees locally (a count of
completed transfers, a status per transfer, a storage hit length) and takes the minimum over all
processes: a transfer counts as done only once it is done everywhere, a prefetch delivers only
the pages every process received. Every process then makes the same change.

* `LocalAgreement`: one process; the identity (what single-process serving uses).
* `ProcessAgreement`: over a channel (``channel.Channel``); one exchange per call, elementwise MIN;
  the values travel as an `AgreedValues` message (``wire``: a tuple of ints, nothing else).

Invariant: callers ask in the same order with the same number of values on every process (their
state agrees, so their pending transfers do); a mismatch in length is a divergence and raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvjax.multihost.channel import Channel, all_gather_message
from kvjax.multihost.errors import DivergenceError
from kvjax.multihost.wire import wire_message
from kvjax.transfer_status import TRANSFER_STATUS_RANK, TransferStatus

__all__ = ["AgreedValues", "Agreement", "LocalAgreement", "ProcessAgreement", "agree_statuses"]


@wire_message("agree", version=1)
@dataclass(frozen=True)
class AgreedValues:
    """One process's values in one agreement: integers, in the caller's order."""

    values: tuple[int, ...]


@runtime_checkable
class Agreement(Protocol):
    """Agrees integer vectors across the processes of one serving group."""

    @property
    def is_local(self) -> bool:
        """True when there is one process (the identity agreement)."""
        ...

    def agree_min(self, tag: str, values: Sequence[int]) -> list[int]:
        """The elementwise minimum of ``values`` over every process (same length everywhere)."""
        ...


class LocalAgreement:
    """One process: every value is already agreed."""

    is_local = True

    def agree_min(self, tag: str, values: Sequence[int]) -> list[int]:
        return [int(v) for v in values]


class ProcessAgreement:
    """MIN over the processes of ``channel``. ``rounds``: agreements made; ``held_back``: values
    this process saw larger than the agreed ones (it was ahead and waited for another process)."""

    is_local = False

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.rounds = 0
        self.held_back = 0

    def agree_min(self, tag: str, values: Sequence[int]) -> list[int]:
        mine = [int(v) for v in values]
        gathered = [m.values for m in all_gather_message(self.channel, f"agree:{tag}", AgreedValues(tuple(mine)))]
        lengths = {len(v) for v in gathered}
        if len(lengths) > 1:
            raise DivergenceError(
                self.channel.exchanges - 1,
                f"agreeing {tag!r}: the processes hold different numbers of values "
                f"({', '.join(f'process {q}: {len(v)}' for q, v in enumerate(gathered))}); their states diverged",
            )
        agreed = [min(column) for column in zip(*gathered, strict=True)] if mine else []
        self.rounds += 1
        self.held_back += sum(a < m for a, m in zip(agreed, mine, strict=True))
        return agreed


# The agreed minimum rank back to its status (PENDING < FAILED < DONE: kvjax.transfer_status).
_STATUS_OF_RANK = {rank: status for status, rank in TRANSFER_STATUS_RANK.items()}


def agree_statuses(agreement: Agreement, tag: str, statuses: Sequence[TransferStatus]) -> list[TransferStatus]:
    """Each transfer's agreed status: PENDING while it is pending on any process, FAILED when it
    failed on any, DONE only when done everywhere."""
    if agreement.is_local:
        return list(statuses)
    ranks = agreement.agree_min(tag, [TRANSFER_STATUS_RANK[s] for s in statuses])
    return [_STATUS_OF_RANK[r] for r in ranks]
