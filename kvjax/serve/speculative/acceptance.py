"""Greedy acceptance of a round's draft tokens (pure numpy, SGLang's greedy tree verification for a
chain of one candidate per step, ``--speculative-eagle-topk 1``).

A round of one request starts from its last token ``t`` (not in the KV yet). The draft proposes
``d_1 .. d_k``; the target, given ``[t, d_1, .., d_k]``, predicts ``g_0 .. g_k`` (``g_i`` is its
greedy token after ``d_i``, ``d_0 = t``). The longest prefix with ``d_{i+1} == g_i`` is accepted,
``n`` tokens, and the target's own next token ``g_n`` follows them (the bonus token), so the round
yields ``g_0 .. g_n``: ``n + 1`` tokens, exactly what the target alone generates greedily.

The yield is then cut where the request ends (``limit_accepted``): at ``max_new_tokens`` and after
the first stop token, as the plain loop stops.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

__all__ = ["accepted_lengths", "limit_accepted"]


def accepted_lengths(draft: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per request, the number of draft tokens accepted, ``n`` in ``0..k``.

    Args:
        draft: int ``[B, k]``: the draft's proposals ``d_1 .. d_k``.
        target: int ``[B, k + 1]``: the target's greedy tokens ``g_0 .. g_k``.

    Returns:
        int64 ``[B]``; the round yields ``target[b, : n[b] + 1]``.
    """
    draft = np.asarray(draft)
    target = np.asarray(target)
    if draft.ndim != 2 or target.shape != (draft.shape[0], draft.shape[1] + 1):
        raise ValueError(f"draft {draft.shape} and target {target.shape}: expected [B, k] and [B, k + 1]")
    agree = draft == target[:, :-1]
    # the first disagreement per row (k when every proposal agrees)
    return np.where(agree.all(axis=1), draft.shape[1], np.argmin(agree, axis=1)).astype(np.int64)


def limit_accepted(tokens: np.ndarray, room: int, stop_token_ids: Collection[int]) -> list[int]:
    """The tokens of a round a request keeps: at most ``room`` (its ``max_new_tokens`` left), and up
    to and including the first stop token."""
    kept = [int(t) for t in tokens[: max(room, 0)]]
    for i, token in enumerate(kept):
        if token in stop_token_ids:
            return kept[: i + 1]
    return kept
