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

    ``cache_salt``: the tenant's cache namespace (vLLM's name for SGLang's ``extra_key``, which it
    sets): requests with different salts never share a cached page, at any tier, and their pages
    hash differently in the KV events and the storage tier's keys.
    ``session_id``: the open session this request is a turn of (``kvjax.serve.sessions``): its
    prompt holds the turn's new tokens only, the session prepends its history at submission.
    ``priority`` and ``retention_seconds``: as ``Req``'s (a retained prefix is evicted last,
    ``kvjax.radix.retention``)."""

    __slots__ = (
        "max_new_tokens",
        "stop_token_ids",
        "session_id",
        "admitted_at",
        "first_cached_tokens",
        "retracted",
        "logits",
        "abort_reason",
    )

    def __init__(
        self,
        rid: Any,
        prompt: Sequence[int] | np.ndarray,
        *,
        max_new_tokens: int,
        extra_key: Any = None,
        stop_token_ids: Iterable[int] = (),
        session_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        retention_seconds: float | None = None,
    ) -> None:
        if max_new_tokens <= 0:
            raise ValueError(f"request {rid!r}: max_new_tokens={max_new_tokens} must be positive")
        if len(prompt) == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty; give at least one token")
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError(f"request {rid!r}: cache_salt={cache_salt!r}: give a non-empty string")
            if extra_key is not None and extra_key != cache_salt:
                raise ValueError(
                    f"request {rid!r}: cache_salt={cache_salt!r} and extra_key={extra_key!r} differ; they name "
                    "the same cache namespace: give one"
                )
            extra_key = cache_salt
        super().__init__(rid, list(prompt), extra_key=extra_key, priority=priority, retention_seconds=retention_seconds)
        self.max_new_tokens = int(max_new_tokens)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.session_id = session_id
        self.admitted_at = -1
        self.first_cached_tokens: int | None = None
        self.retracted = 0
        self.logits: list[np.ndarray] = []  # one float32 [vocab] row per output token, with record_logits
        self.abort_reason: str | None = None  # why it ended unserved (``RequestAborted``), else None

    @property
    def done(self) -> bool:
        """``max_new_tokens`` generated, or the last one is a stop token (it is kept in the output)."""
        out = self.output_ids
        return len(out) >= self.max_new_tokens or (bool(out) and out[-1] in self.stop_token_ids)
