"""The jitted steps of speculative serving, each with the pools donated (every KV write in place).

* ``make_paired_prefill_step``: the target's prefill forward and the draft's on the same tokens
  and metadata (the draft mirrors the target's prefill into ``"kv_draft"``, at the same slots);
  the scheduler's step signature ``step(pools, params, tokens, meta) -> (pools, next_tokens[,
  logits])`` with the draft's weights bound.
* ``make_round_step``: one speculative round in one dispatch: the draft's ``k + 1`` decode steps
  (``proposer.propose``), then the target's verify forward over ``[t, d_1, .., d_k]``
  (``verifier.verify``); returns ``(pools, proposals int32 [S, k], greedy int32 [S, k + 1])`` and,
  with logits, the target's float32 logits ``[S, k + 1, vocab]``. ``k`` and the token buckets are
  read from the metadata's shapes (one compile per batch shape).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from kvjax.attention import AttentionMetadata
from kvjax.pools import CachePools
from kvjax.serve.model import build_model
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.speculative.draft_view import draft_view, with_draft
from kvjax.serve.speculative.proposer import propose
from kvjax.serve.speculative.verifier import round_tokens, verify
from kvjax.serve.step import step_body

__all__ = ["make_paired_prefill_step", "make_round_step"]

StepFn = Callable[..., tuple[Any, ...]]


def make_paired_prefill_step(
    target: ModelConfig, draft: ModelConfig, draft_params: Any, *, with_logits: bool
) -> StepFn:
    """The scheduler's prefill step running the ``target`` model then the ``draft`` model (their
    serving configs; ``draft_params`` bound) on one batch."""
    jitted = _paired_prefill(target, draft, with_logits)

    def step(pools: CachePools, params: Any, tokens: Any, meta: AttentionMetadata) -> tuple[Any, ...]:
        return jitted(pools, params, draft_params, tokens, meta)

    return step


@functools.lru_cache(maxsize=8)
def _paired_prefill(target_config: ModelConfig, draft_config: ModelConfig, with_logits: bool) -> Any:
    target: Any = build_model(target_config)
    draft: Any = build_model(draft_config)

    def body(
        pools: CachePools, params: Any, draft_params: Any, tokens: jax.Array, meta: AttentionMetadata
    ) -> tuple[Any, ...]:
        pools, *sampled = step_body(target, pools, params, tokens, meta, with_logits=with_logits)
        mirrored, _ = step_body(draft, draft_view(pools), draft_params, tokens, meta, sample=False)
        return (with_draft(pools, mirrored["kv"]), *sampled)

    return jax.jit(body, donate_argnums=0)


def make_round_step(target: ModelConfig, draft: ModelConfig, *, with_logits: bool) -> Any:
    """``round(pools, params, draft_params, first_tokens [S], draft_metas, verify_meta)``: the
    module docstring's round, jitted with the pools donated (cached per pair of models)."""
    return _round_step(target, draft, with_logits)


@functools.lru_cache(maxsize=8)
def _round_step(target_config: ModelConfig, draft_config: ModelConfig, with_logits: bool) -> Any:
    target, draft = build_model(target_config), build_model(draft_config)

    def body(
        pools: CachePools,
        params: Any,
        draft_params: Any,
        first_tokens: jax.Array,
        draft_metas: AttentionMetadata,
        verify_meta: AttentionMetadata,
    ) -> tuple[Any, ...]:
        steps, draft_width = draft_metas.positions.shape
        k = steps - 1
        pools, proposals = propose(draft, draft_params, pools, first_tokens, draft_metas, draft_width)
        tokens = round_tokens(first_tokens, proposals[:k], verify_meta.positions.shape[0])
        pools, greedy, logits = verify(target, params, pools, tokens, verify_meta, k + 1)
        out = (pools, proposals[:k].T, greedy)
        return (*out, logits) if with_logits else out

    return jax.jit(body, donate_argnums=0)
