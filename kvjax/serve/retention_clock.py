"""`RetentionClock`: the serving loop's reading of the retention clock, agreed across processes.

The tree never reads a clock itself (``kvjax.radix.retention``): when a retention expires must
be the same decision on every process of a multi-process run, or their trees evict different
nodes and diverge. The scheduler reads this clock once per step, before the step changes the
tree, and hands the reading to the tree (``advance_retention_clock``).

Semantics of a reading: seconds from the clock callable (default ``time.monotonic``: one
process's own clock; tests pass a callable they advance by hand). With several processes each
reads its own clock and the step uses the minimum over all of them (``Agreement.agree_min`` over
whole microseconds), so every process applies the same reading, and a retention expires only
once it has expired on every process's clock. The tree's clock never runs backwards, so a
process whose clock lags only delays expiries. One process (``LocalAgreement``) uses its reading
as it is, no exchange.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvjax.multihost.agreement import Agreement, LocalAgreement
from kvjax.radix.retention import check_clock_reading

__all__ = ["RetentionClock"]

#: Agreed readings are whole microseconds (the agreement exchanges integers).
_TICKS_PER_SECOND = 1_000_000


class RetentionClock:
    """One agreed reading per call of :meth:`read`.

    Args:
        clock: seconds (any finite float, only differences matter); default ``time.monotonic``.
        agreement: the processes' agreement (default one process: the reading as it is).

    Attributes:
        readings: readings taken; ``last``: the last one agreed (None before any).
    """

    def __init__(self, clock: Callable[[], float] | None = None, agreement: Agreement | None = None) -> None:
        if clock is not None and not callable(clock):
            raise ValueError(f"retention clock {clock!r}: give a callable returning seconds")
        self.clock: Callable[[], float] = time.monotonic if clock is None else clock
        self.agreement: Agreement = LocalAgreement() if agreement is None else agreement
        self.readings = 0
        self.last: float | None = None

    def read(self) -> float:
        """The clock's reading, agreed (the minimum over the processes, in whole microseconds).

        Raises ValueError for a reading that is not a finite number (before any exchange)."""
        now = check_clock_reading(self.clock())
        if not self.agreement.is_local:
            ticks = math.floor(now * _TICKS_PER_SECOND)
            now = self.agreement.agree_min("retention_clock", [ticks])[0] / _TICKS_PER_SECOND
        self.readings += 1
        self.last = now
        return now
