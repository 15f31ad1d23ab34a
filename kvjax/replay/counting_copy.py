"""`CountingCopyEngine`: a host-tier copy engine for replays that moves nothing and counts tokens.

The host tier (``kvjax.radix.HiRadixCache``) needs a copy engine; a replay has no KV bytes to
copy, and ``kvjax.tiers.SimulatedCopyEngine`` records every slot of every transfer (tests read
them back), which costs O(tokens) of Python objects per copy on a long trace. This engine keeps
two counters; every transfer has landed by the next poll (``poll`` answers DONE), as a copy that
finishes within one scheduler step would.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvjax.tiers.copy_engine import TransferStatus

__all__ = ["CountingCopyEngine"]


class CountingCopyEngine:
    """A ``kvjax.tiers.CopyEngine`` that copies nothing (module docstring).

    Attributes:
        backed_up_tokens: slots copied device -> host so far.
        loaded_tokens: slots copied host -> device so far.
    """

    def __init__(self) -> None:
        self.backed_up_tokens = 0
        self.loaded_tokens = 0

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> Any:
        self.backed_up_tokens += int(np.shape(device_slots)[0])
        return None

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> Any:
        self.loaded_tokens += int(np.shape(host_slots)[0])
        return None

    def poll(self, handle: Any, wait: bool = False) -> TransferStatus:
        return TransferStatus.DONE

    def cancel(self, handle: Any) -> None:
        return None
