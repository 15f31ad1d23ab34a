"""The tiny DP caches and per-rank requests that the DP check programs share.

Each check builds a DP cache (``kvjax.dp.build_dp_kv_cache``) of ``dp`` ranks, gives every rank
its own requests (a different count and lengths per rank, rows from the rank's request table and
slots from its own allocator), then steps them: one prefill of every prompt, then decode steps of
one token per request.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvjax import CacheConfig
from kvjax.attention import MetadataBuilder
from kvjax.attention.metadata import AttentionMetadata
from kvjax.dp import DPKVCache, DPRank

PAGE = 4  # tokens per page
MAX_SEQS = 4  # padded rows of a step; a rank has at most 3 requests

RankRequests = tuple[DPRank, np.ndarray, list[int]]
"""A rank, its requests' rows of the request table (int64 ``[n]``) and their prompt lengths."""


def dp_config(dp: int, tp: int, **changes: Any) -> CacheConfig:
    """A 128-token pool per rank of 4-token pages, 32-token context, DP attention over ``dp``
    ranks of ``tp`` devices each; ``changes`` replace any of these settings."""
    settings: dict[str, Any] = dict(
        max_total_tokens=128,
        page_size=PAGE,
        tp_size=dp * tp,
        dp_size=dp,
        enable_dp_attention=True,
        context_length=32,
        max_running_requests=MAX_SEQS,
    )
    return CacheConfig(**{**settings, **changes})


def place_rank_requests(cache: DPKVCache, rng: np.random.Generator, decode_tokens: int) -> list[RankRequests]:
    """Give rank ``r`` ``1 + r % 3`` requests of 3 to 11 prompt tokens (drawn from ``rng``): a row
    of its request table each, holding page-rounded slots from its own allocator for the prompt
    and ``decode_tokens`` more tokens."""
    ranks = []
    for rank in cache.ranks:
        lens = [int(x) for x in rng.integers(3, 12, size=1 + rank.rank % 3)]
        rows = np.asarray(rank.req_to_token_pool.alloc(len(lens)), np.int64)
        for row, n in zip(rows, lens, strict=True):
            tokens = n + decode_tokens
            slots = rank.allocator.alloc(-(-tokens // PAGE) * PAGE)
            rank.req_to_token_pool.write(int(row), 0, slots[:tokens])
        ranks.append((rank, rows, lens))
    return ranks


def rank_step_inputs(
    requests: RankRequests, tokens: list[np.ndarray] | np.ndarray, decode_step: int | None
) -> tuple[np.ndarray, AttentionMetadata]:
    """One rank's ``(tokens, metadata)`` of a step (``MetadataBuilder.build``): the prefill of
    every prompt (``decode_step`` None; ``tokens`` one int array per request, of its prompt
    length), or decode step ``decode_step`` (0 first): one token per request (``tokens`` int
    ``[n]``) at position ``prompt length + decode_step``."""
    rank, rows, lens = requests
    builder = MetadataBuilder(rank.req_to_token_pool, PAGE, MAX_SEQS)
    table = rank.req_to_token_pool.req_to_token
    prompt_lens = np.asarray(lens, np.int32)
    if decode_step is None:
        starts = np.zeros(len(lens), np.int32)
        slots = np.concatenate([table[row, :n] for row, n in zip(rows, lens, strict=True)])
        seq_lens = prompt_lens
    else:
        starts = prompt_lens + decode_step
        slots = np.asarray([table[row, s] for row, s in zip(rows, starts, strict=True)])
        seq_lens = starts + 1
    return builder.build(tokens=tokens, starts=starts, slots=slots, rows=rows, seq_lens=seq_lens)
