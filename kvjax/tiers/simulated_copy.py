"""`SimulatedCopyEngine`: a copy engine without device arrays, for simulation and fault injection.

It moves *labels*, not bytes: ``device`` and ``host`` map a slot id to whatever the caller
stored there (tests write a token id per device slot), so a test can check that what comes back
from the host is what went out. A transfer lands when it is polled ``polls_to_finish`` times
(1: at the next polling step) or waited on.

Faults: ``fail_backups = k`` makes the next ``k`` backups report FAILED when they complete (their
host slots are left untouched); ``fail_loads = k`` makes the next ``k`` loads raise
:class:`CopyError` at start. Every transfer is recorded in ``log``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvjax.tiers.copy_engine import CopyError, TransferStatus


@dataclass
class _Transfer:
    kind: str
    src: np.ndarray
    dst: np.ndarray
    polls_left: int
    fail: bool
    status: TransferStatus = TransferStatus.PENDING
    cancelled: bool = False
    payload: list[Any] = field(default_factory=list)


@dataclass
class SimulatedCopyEngine:
    """See the module docstring."""

    polls_to_finish: int = 1
    fail_backups: int = 0
    fail_loads: int = 0
    device: dict[int, Any] = field(default_factory=dict)
    host: dict[int, Any] = field(default_factory=dict)
    log: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def _start(self, kind: str, src: np.ndarray, dst: np.ndarray, fail: bool) -> _Transfer:
        src = np.asarray(src, dtype=np.int64).copy()
        dst = np.asarray(dst, dtype=np.int64).copy()
        if src.shape != dst.shape:
            raise ValueError(f"{kind}: {src.size} source slots for {dst.size} destination slots")
        self.log.append((kind, tuple(int(x) for x in src), tuple(int(x) for x in dst)))
        # The bytes are read now (the device state at start), as a real engine reads them.
        source = self.device if kind == "backup" else self.host
        t = _Transfer(kind, src, dst, max(self.polls_to_finish, 0), fail, payload=[source.get(int(s)) for s in src])
        if kind == "load":  # a load that started lands (the device sees it before any reader)
            self._land(t)
        return t

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> _Transfer:
        fail = self.fail_backups > 0
        if fail:
            self.fail_backups -= 1
        return self._start("backup", device_slots, host_slots, fail)

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> _Transfer:
        if self.fail_loads > 0:
            self.fail_loads -= 1
            raise CopyError("simulated load failure (injected)")
        return self._start("load", host_slots, device_slots, False)

    def _land(self, t: _Transfer) -> None:
        target = self.host if t.kind == "backup" else self.device
        for d, v in zip(t.dst, t.payload, strict=True):
            target[int(d)] = v

    def poll(self, handle: _Transfer, wait: bool = False) -> TransferStatus:
        t = handle
        if t.status is not TransferStatus.PENDING:
            return t.status
        t.polls_left -= 1
        if not wait and t.polls_left > 0:
            return TransferStatus.PENDING
        if t.fail:
            t.status = TransferStatus.FAILED
            return t.status
        if not t.cancelled and t.kind == "backup":
            self._land(t)
        t.status = TransferStatus.DONE
        return t.status

    def cancel(self, handle: _Transfer) -> None:
        handle.cancelled = True
