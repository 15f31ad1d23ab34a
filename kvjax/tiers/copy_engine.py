"""`CopyEngine`: how the host tier starts and completes page copies (jax-free protocol).

SGLang's ``HiCacheController`` shape: a backup (device -> host) or a load (host -> device) is
*started* without blocking and *completed* at the scheduler's next polling step
(``writing_check`` / ``loading_check``), which asks each started transfer for its status. The
tree locks a node while a transfer on it is pending.

Contract of an engine:

* ``start_backup(device_slots, host_slots)``: start copying the device slots' KV into the host
  slots; returns a handle. The data must be read from the device state as it is now.
* ``start_load(host_slots, device_slots)``: start copying host slots into device slots; returns a
  handle, or raises :class:`CopyError` when it cannot start (nothing changed: the caller falls
  back to recompute). A load that started completes (``poll`` never reports FAILED for it), so
  readers of those device slots need no extra check, as in SGLang. The host slots must stay
  allocated and unwritten until ``poll`` reports the load DONE (an engine may read them in place).
* ``poll(handle, wait=False)``: PENDING, DONE (the bytes landed) or FAILED (a backup that did
  not land: the host slots hold garbage). ``wait=True`` blocks until it is not PENDING.
* ``cancel(handle)``: the transfer must never land (its slots are about to be reused).

`TransferStatus` is defined in the core module ``kvjax.transfer_status`` (so the multi-process
agreement orders statuses without importing the host tier) and re-exported here.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvjax.transfer_status import TransferStatus

__all__ = ["CopyEngine", "CopyError", "TransferStatus"]


class CopyError(RuntimeError):
    """A transfer could not start (or, for a backup, did not land)."""


@runtime_checkable
class CopyEngine(Protocol):
    """See the module docstring."""

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> Any: ...

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> Any: ...

    def poll(self, handle: Any, wait: bool = False) -> TransferStatus: ...

    def cancel(self, handle: Any) -> None: ...
