"""`AgreedCopyEngine`: a host tier's copy engine whose completions every process agrees on.

The host tier (``HostTierComponent``) learns that a backup or a load landed by polling its copy
engine; the tree then unlocks nodes, frees host slots of failed backups and tracks duplicates.
Polled locally, processes see completions at different times and their trees diverge (what
sglang-jax's host tier does across hosts). Wrapped in this engine, a poll answers the *agreed*
status (``agreement.agree_statuses``): done once done on every process, failed once failed on any.

``agree_round()`` (the serving loop's polling step, before the tree's ``check_transfers``) polls
every outstanding transfer locally and agrees them all in one exchange; the tree's polls that
follow read those answers. A poll outside a round (``wait=True``, or right after a start) agrees
that one transfer on its own exchange. Both happen in the same order on every process, because
their trees (and so their transfers) are the same.

Invariant: ``outstanding`` is every started transfer not yet answered as finished, in start
order; a transfer answered DONE or FAILED is never polled on the wrapped engine again by this
wrapper (engines answer repeated polls of a finished transfer with its status anyway).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvjax.multihost.agreement import Agreement, agree_statuses
from kvjax.tiers.copy_engine import CopyEngine, TransferStatus

__all__ = ["AgreedCopyEngine"]


class AgreedCopyEngine:
    """``engine`` with every poll agreed through ``agreement`` (module docstring)."""

    def __init__(self, engine: CopyEngine, agreement: Agreement) -> None:
        self.engine = engine
        self.agreement = agreement
        self.outstanding: list[Any] = []
        self._round: dict[int, TransferStatus] = {}
        self.rounds = 0

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> Any:
        handle = self.engine.start_backup(device_slots, host_slots)
        self.outstanding.append(handle)
        return handle

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> Any:
        handle = self.engine.start_load(host_slots, device_slots)
        self.outstanding.append(handle)
        return handle

    def cancel(self, handle: Any) -> None:
        self.engine.cancel(handle)

    def agree_round(self) -> None:
        """Poll every outstanding transfer locally and agree their statuses in one exchange;
        the polls until the next round read the agreed answers. Transfers agreed finished in an
        earlier round that nobody asked about are dropped (nothing waits on them)."""
        stale = {h for h, s in self._round.items() if s is not TransferStatus.PENDING}
        if stale:
            self.outstanding = [h for h in self.outstanding if id(h) not in stale]
        self._round = {}
        if not self.outstanding:
            return
        local = [self.engine.poll(h) for h in self.outstanding]
        agreed = agree_statuses(self.agreement, "host transfers", local)
        self._round = {id(h): s for h, s in zip(self.outstanding, agreed, strict=True)}
        self.rounds += 1

    def poll(self, handle: Any, wait: bool = False) -> TransferStatus:
        status = None if wait else self._round.get(id(handle))
        if status is None:
            status = agree_statuses(self.agreement, "host transfer", [self.engine.poll(handle, wait)])[0]
        if status is not TransferStatus.PENDING:
            self._finished(handle)
        return status

    def _finished(self, handle: Any) -> None:
        self._round.pop(id(handle), None)
        for i, h in enumerate(self.outstanding):
            if h is handle:
                del self.outstanding[i]
                break

    def __getattr__(self, name: str) -> Any:
        # Everything else (an engine's own counters, its staging options) is the wrapped engine's.
        return getattr(self.engine, name)
