"""`Req`: the per-request state the prefix tree and the serving loop share.

Token ids may be Python lists or 1-D integer numpy arrays. The tree reads them through
:meth:`Req.token_range` / :meth:`Req.fill_range`, which never build the whole
``origin_input_ids + output_ids`` sequence, so caching a chunk of a 1M-token request costs
O(chunk), not O(request).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

_UNSET = object()


def _length(x: Any) -> int:
    return int(x.shape[0]) if isinstance(x, np.ndarray) else len(x)


def _concat(a: Any, b: Any) -> Any:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a = np.asarray(a)
        return np.concatenate([a, np.asarray(b, dtype=a.dtype if a.size else None)])
    return list(a) + list(b)


def finite_seconds(value: Any, what: str, hint: str, *, minimum: float = -math.inf) -> float:
    """``value`` as a finite float of seconds, at least ``minimum``. Raises ValueError naming
    ``what`` and the value (then ``hint``) for a bool, a string, a non-number, a NaN, an infinity
    or a number below ``minimum``."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{what}={value!r}: {hint}")
    try:
        seconds = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}={value!r}: {hint}") from exc
    if not math.isfinite(seconds) or seconds < minimum:
        raise ValueError(f"{what}={value!r}: {hint}")
    return seconds


def check_retention_seconds(value: Any, what: str = "retention_seconds") -> float | None:
    """``value`` as seconds (float), or None for no retention.

    Raises ValueError naming ``what`` and the value for a bool, a non-number, a NaN, an infinity
    or a negative number.
    """
    if value is None:
        return None
    return finite_seconds(value, what, "give a finite number of seconds >= 0, or None for no retention", minimum=0.0)


class Req:
    """A request, as far as the KV cache is concerned.

    Attributes:
        rid: the request's id (any hashable; used in messages only).
        origin_input_ids: prompt token ids (list or 1-D int array).
        output_ids: generated token ids so far (list; append as tokens are sampled).
        extra_key: prefix-cache namespace (LoRA id, cache salt); requests with different
            extra keys never share cached prefixes. None: the default namespace.
        priority: scheduling/eviction priority; the tree keeps, per node, the max priority of
            the requests that inserted through it (``priority`` eviction policy).
        retention_seconds: ask the tree to keep this request's prefix: every node it inserts
            through is retained for this many seconds of the tree's retention clock, at
            ``priority``; retained nodes are evicted last, never pinned
            (``kvjax.radix.retention``). None (the default) or 0: no retention. A finite
            number >= 0.
        req_pool_idx: this request's row in ``ReqToTokenPool.req_to_token`` (None until one
            is allocated). Row entry ``i`` is the KV slot of token ``i``.
        prefix_indices: int32 KV slots of the cached prefix the request starts from (from
            ``match_prefix``), then, after ``cache_unfinished_req``, of every token whose KV
            exists (a read-only view of the request's row for radix trees).
        last_node: the tree node where the request's cached prefix ends; the request holds a
            lock on it (and its ancestors) while it runs. None or the root: nothing locked.
        lock_receipt: the receipt of that lock when the tree took it (``cache_unfinished_req``
            moves it); None when the caller locked ``last_node`` itself.
        cache_protected_len: leading tokens whose slots belong to the tree (locked through
            ``last_node``), not to the request; the lifecycle frees only slots at or after it.
            With page_size > 1 it is page-aligned, while ``prefix_indices`` may also hold a
            partial page that the request still owns.
        cache_inserted_len: the longest (page-aligned) key this request has inserted into the
            tree so far; a node counts one hit per request, when it ends past this (SGLang
            0.5.23's ``req.kv.cache_inserted_len``). The tree resets it to 0 on release.
        kv_committed_len: tokens of ``origin_input_ids + output_ids`` whose KV slots are written
            in the request's row. None: all of them. (In a real loop the last sampled token
            has no KV yet; the loop sets this.)
        finished: set by the serving loop when the request is done.
        cached_tokens: prompt tokens served from the cache (per-request hit count, for usage
            reports); set by whoever matched the request.
        swa_evicted_seqlen: hybrid sliding-window models: leading tokens whose SWA slots the
            request already freed (they left the window while decoding); page-aligned, grows
            monotonically, starts at ``cache_protected_len`` (SGLang's ``req.swa_evicted_seqlen``).
        fill_ids: tokens whose KV exists after the current forward (``cache_unfinished_req``
            caches these). Defaults to ``(origin_input_ids + output_ids)[:kv_committed_len]``;
            chunked prefill assigns the chunk's end explicitly, as SGLang does.

    Recurrent state (hybrid SSM models; ``kvjax.hybrid_req_pool``, ``kvjax.radix.mamba_radix_cache``):
        mamba_pool_idx: the request's state slot (None until the request table or a
            copy-on-write match gives it one); it holds the state after the request's last
            processed token.
        mamba_cow_src_index: the tree checkpoint slot the request's state was forked from at its
            match (None: the request starts from no state).
        mamba_ping_pong_track_buffer: with the extra buffer, the request's ping-pong slots
            (int32 numpy), where the model tracks states at checkpoint positions.
        mamba_last_track_idx / mamba_last_track_seqlen: with the extra buffer, which ping-pong
            slot holds the last tracked state and after how many tokens (set by the model
            runner; None: nothing tracked yet).
    """

    def __init__(
        self,
        rid: Hashable,
        origin_input_ids: Sequence[int] | np.ndarray,
        output_ids: list[int] | None = None,
        *,
        extra_key: Hashable = None,
        priority: int = 0,
        retention_seconds: float | None = None,
        req_pool_idx: int | None = None,
        prefix_indices: np.ndarray | None = None,
        last_node: Any = None,
        lock_receipt: Any = None,
        cache_protected_len: int = 0,
        cache_inserted_len: int = 0,
        kv_committed_len: int | None = None,
        finished: bool = False,
        cached_tokens: int = 0,
        fill_ids: Any = _UNSET,
        swa_evicted_seqlen: int = 0,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.output_ids = [] if output_ids is None else output_ids
        self.extra_key = extra_key
        self.priority = 0 if priority is None else int(priority)
        self.retention_seconds = check_retention_seconds(retention_seconds, f"request {rid!r}: retention_seconds")
        self.req_pool_idx = req_pool_idx
        self.prefix_indices = np.empty(0, np.int32) if prefix_indices is None else prefix_indices
        self.last_node = last_node
        self.lock_receipt = lock_receipt
        self.cache_protected_len = int(cache_protected_len)
        self.cache_inserted_len = int(cache_inserted_len)
        self.kv_committed_len = kv_committed_len
        self.finished = finished
        self.cached_tokens = cached_tokens
        self._fill_ids = None if fill_ids is _UNSET else fill_ids
        self.swa_evicted_seqlen = int(swa_evicted_seqlen)
        self.mamba_pool_idx: int | None = None
        self.mamba_cow_src_index: int | None = None
        self.mamba_ping_pong_track_buffer: np.ndarray | None = None
        self.mamba_last_track_idx: int | None = None
        self.mamba_last_track_seqlen: int | None = None

    # -- token views ---------------------------------------------------------------------------

    @property
    def fill_ids(self) -> Any:
        """Tokens whose KV exists after this forward (see the class docstring)."""
        if self._fill_ids is not None:
            return self._fill_ids
        ids = _concat(self.origin_input_ids, self.output_ids)
        return ids if self.kv_committed_len is None else ids[: self.kv_committed_len]

    @fill_ids.setter
    def fill_ids(self, value: Any) -> None:
        self._fill_ids = value

    def seqlen(self) -> int:
        """``len(origin_input_ids) + len(output_ids)``."""
        return _length(self.origin_input_ids) + _length(self.output_ids)

    def kv_len(self) -> int:
        """Tokens with KV in the request's row: ``kv_committed_len`` or :meth:`seqlen`."""
        return self.seqlen() if self.kv_committed_len is None else int(self.kv_committed_len)

    def fill_len(self) -> int:
        """``len(fill_ids)`` in O(1)."""
        return _length(self._fill_ids) if self._fill_ids is not None else self.kv_len()

    def token_range(self, start: int, end: int) -> Any:
        """Tokens ``[start, end)`` of ``origin_input_ids + output_ids``, built in O(end - start)."""
        inp = self.origin_input_ids
        n_in = _length(inp)
        if end <= n_in:
            return inp[start:end]
        out = self.output_ids
        if start >= n_in:
            return out[start - n_in : end - n_in]
        return _concat(inp[start:], out[: end - n_in])

    def fill_range(self, start: int, end: int) -> Any:
        """Tokens ``[start, end)`` of :attr:`fill_ids`, built in O(end - start)."""
        if self._fill_ids is not None:
            return self._fill_ids[start:end]
        return self.token_range(start, end)

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, input={_length(self.origin_input_ids)}, output={_length(self.output_ids)}, "
            f"req_pool_idx={self.req_pool_idx}, cache_protected_len={self.cache_protected_len})"
        )
