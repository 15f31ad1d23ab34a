"""`ServingReq`: a request of the serving loop (a ``kvjax.request.Req`` plus generation limits).

Kept apart from the scheduler so that building workloads (``kvjax.serve.workload``) and the
command line import no jax.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvjax.request import Req


class ServingReq(Req):
    """A request of the serving loop: a ``Req`` plus its generation limit and bookkeeping.

    ``priority`` and ``retention_seconds``: as ``Req``'s (a retained prefix is evicted last,
    ``kvjax.radix.retention``)."""

    __slots__ = ("max_new_tokens", "stop_token_ids", "admitted_at", "first_cached_tokens", "retracted", "logits")

    def __init__(
        self,
        rid: Any,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        extra_key: Any = None,
        stop_token_ids: Iterable[int] = (),
        priority: int = 0,
        retention_seconds: float | None = None,
    ) -> None:
        if max_new_tokens <= 0:
            raise ValueError(f"request {rid!r}: max_new_tokens={max_new_tokens} must be positive")
        if len(prompt) == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty; give at least one token")
        super().__init__(rid, list(prompt), extra_key=extra_key, priority=priority, retention_seconds=retention_seconds)
        self.max_new_tokens = int(max_new_tokens)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.admitted_at = -1
        self.first_cached_tokens: int | None = None
        self.retracted = 0
        self.logits: list[np.ndarray] = []  # one float32 [vocab] row per output token, with record_logits

    @property
    def done(self) -> bool:
        """``max_new_tokens`` generated, or the last one is a stop token (it is kept in the output)."""
        out = self.output_ids
        return len(out) >= self.max_new_tokens or (bool(out) and out[-1] in self.stop_token_ids)
