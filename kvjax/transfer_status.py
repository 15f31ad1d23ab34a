"""`TransferStatus`: the state of one host-tier page copy, and the order processes agree it in.

A core module: the copy engines (``kvjax.tiers.copy_engine``, host layer, which re-exports it)
report these statuses, and ``kvjax.multihost.agreement`` (core layer) agrees them across
processes; neither has to import the other's layer.

Agreement order: ``PENDING < FAILED < DONE`` (``TRANSFER_STATUS_RANK``). The minimum over
processes is PENDING while any process still waits, FAILED once none waits and any failed, and
DONE only when the copy landed everywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["TRANSFER_STATUS_RANK", "TransferStatus"]


class TransferStatus(enum.Enum):
    """PENDING: started, not finished; DONE: the bytes landed; FAILED: a backup that did not
    land (its host slots hold garbage)."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


#: Each status's rank in the agreement order (PENDING < FAILED < DONE); a bijection onto 0, 1, 2.
TRANSFER_STATUS_RANK: Mapping[TransferStatus, int] = MappingProxyType(
    {TransferStatus.PENDING: 0, TransferStatus.FAILED: 1, TransferStatus.DONE: 2}
)
