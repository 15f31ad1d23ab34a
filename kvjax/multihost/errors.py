"""The errors of multi-process serving: a process that stopped answering, and processes whose
state diverged. Both stop the run on the process that raises them; the message names the other
process and what it was waiting for (or what differs)."""

from __future__ import annotations

__all__ = ["CoordinatorError", "DivergenceError", "ProcessLostError"]


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
