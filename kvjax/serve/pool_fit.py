"""Whether a workload can ever run on a cache: the clear errors of the serving loop when it cannot.

* ``check_fits_pool`` (at submission): a request's KV at its last step, ``prompt + max_new_tokens
  - 1`` tokens rounded up to whole pages, must fit the full-attention pool on its own; a request
  that does not can never run (retraction frees everything else, and still it would not fit), so
  it is refused before it is queued with a ``ConfigError`` naming ``max_total_tokens``. A pure
  sliding-window cache (every layer sliding) is not checked: a request there holds about one
  window of KV, whatever its length.
* ``no_progress_error`` (at a step that could run nothing): what the scheduler raises instead of
  looping forever: an ``OutOfMemoryError`` naming the pool, what the request at the head of the
  queue needs, and the settings that fix it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.errors import ConfigError, OutOfMemoryError

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol
    from kvjax.serve.serving_req import ServingReq

__all__ = ["check_fits_pool", "full_pool_tokens", "kv_tokens_needed", "no_progress_error"]


def full_pool_tokens(alloc: AllocatorProtocol) -> int:
    """Token slots of the full-attention pool: ``size_full`` where the allocator pairs two sides
    (hybrid sliding window: ``size`` is the smaller side's), else ``size``."""
    return int(getattr(alloc, "size_full", alloc.size))


def kv_tokens_needed(req: ServingReq, page_size: int) -> int:
    """Token slots the request holds at its last step: ``prompt + max_new_tokens - 1`` (the last
    sampled token is never fed back), rounded up to whole pages of ``page_size``."""
    tokens = len(req.origin_input_ids) + req.max_new_tokens - 1
    return -(-tokens // page_size) * page_size


def check_fits_pool(req: ServingReq, alloc: AllocatorProtocol, page_size: int, *, windowed: bool = False) -> None:
    """Raise ``ConfigError`` (option ``max_total_tokens``) when ``req`` alone can never fit the
    full-attention pool; nothing when a request holds only about one window of KV whatever its
    length (``windowed``: a pure sliding-window cache, ``PlannerKind.windowed_request_kv``)."""
    if windowed:
        return
    need = kv_tokens_needed(req, page_size)
    pool = full_pool_tokens(alloc)
    if need > pool:
        raise ConfigError(
            "max_total_tokens",
            pool,
            f"request {req.rid!r} needs {need} KV token slots ({len(req.origin_input_ids)} prompt + "
            f"{req.max_new_tokens} new tokens, in pages of {page_size}) but the pool holds {pool}; raise "
            f"max_total_tokens to at least {need}, or shorten the request or its max_new_tokens",
        )


def no_progress_error(
    head: ServingReq, waiting: int, alloc: AllocatorProtocol, rows: ReqToTokenPoolProtocol, budget: int
) -> OutOfMemoryError:
    """The error of a step that could neither prefill nor decode while ``waiting`` requests wait
    (``head``: the one first in line)."""
    return OutOfMemoryError(
        f"no progress: request {head.rid!r} ({head.seqlen()} tokens, {waiting} waiting) cannot be admitted: "
        f"the KV pool has {alloc.available_size()} of {full_pool_tokens(alloc)} token slots free after eviction, "
        f"{rows.available_size()} of {rows.size} request rows are free, and the prefill budget is {budget} tokens; "
        "raise max_total_tokens, lower chunked_prefill_size, or submit fewer requests at once"
    )
