"""A request's key with its items' pad values (SGLang's ``pad_input_tokens``,
``MultiModalityDataPaddingPatternMultimodalTokens``): the prompt with each item's placeholder
positions replaced by that item's pad value.

The padded prompt is what the request carries as ``origin_input_ids`` (as SGLang's scheduler
pads the request's ids before matching it), so every consumer of the key reads the image's
identity with no change of its own: ``Req.token_range`` / ``fill_range`` feed the prefix tree,
the tree's KV events and the host and storage tiers' page hashes hash whatever the key holds.
Consequences, at every page size: the same image behind the same text is the same key (its KV is
reused, whole pages of it); a different image, or the same pixels preprocessed differently,
diverges at its first placeholder position, so a match stops at the last whole page before it;
an image that ends mid-page shares that page with the text that follows, and the page matches
only when both agree.

The model reads the original placeholder id at those positions (or, in SGLang, any id in range:
the embedding of a pad position is replaced by the image's); the items say where they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvjax.multimodal.item import MultimodalItem

__all__ = ["pad_input_ids", "placeholder_ranges"]


def _as_list(input_ids: Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(input_ids, np.ndarray):
        if input_ids.ndim != 1 or input_ids.dtype.kind not in "iu":
            raise ValueError(
                f"input_ids of shape {input_ids.shape} and dtype {input_ids.dtype}: give a 1-D integer array"
            )
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


def placeholder_ranges(
    input_ids: Sequence[int] | np.ndarray, placeholder_token_id: int, tokens_per_item: Sequence[int]
) -> list[tuple[int, int]]:
    """Each item's ``[start, end)`` placeholder positions: the prompt's placeholder positions in
    order, item ``i`` taking the next ``tokens_per_item[i]`` of them, which must be contiguous.

    Raises:
        ValueError: the placeholder count is not ``sum(tokens_per_item)`` (an item count that
            does not match the placeholders), an item's count is below 1, or an item's positions
            are not one contiguous run.
    """
    ids = _as_list(input_ids)
    counts = [int(n) for n in tokens_per_item]
    bad = [n for n in counts if n < 1]
    if bad:
        raise ValueError(f"tokens_per_item={counts}: every item covers at least one placeholder position")
    positions = [i for i, t in enumerate(ids) if t == placeholder_token_id]
    if len(positions) != sum(counts):
        raise ValueError(
            f"the prompt holds {len(positions)} placeholder tokens (id {placeholder_token_id}) but {len(counts)} "
            f"items need {sum(counts)} ({counts}): give one item per image the prompt names, each with its "
            "placeholder count"
        )
    ranges: list[tuple[int, int]] = []
    at = 0
    for n in counts:
        start, last = positions[at], positions[at + n - 1]
        if last - start + 1 != n:
            raise ValueError(
                f"item {len(ranges)}'s {n} placeholder tokens (id {placeholder_token_id}) are not contiguous "
                f"(positions {start}..{last}): an item's placeholders must be one run"
            )
        ranges.append((start, last + 1))
        at += n
    return ranges


def pad_input_ids(
    input_ids: Sequence[int] | np.ndarray, items: Sequence[MultimodalItem], placeholder_token_id: int
) -> list[int]:
    """A new list: ``input_ids`` with each item's positions ``[start, end)`` set to its pad value.

    Checks, before changing anything: the items are in prompt order and disjoint, inside the
    prompt, every position they cover holds ``placeholder_token_id`` and every placeholder of the
    prompt is covered by an item.

    Raises:
        ValueError: naming the item and the position that breaks a check (``input_ids`` is never
            changed).
    """
    ids = _as_list(input_ids)
    prev_end = 0
    covered = 0
    for i, item in enumerate(items):
        if not isinstance(item, MultimodalItem):
            raise ValueError(f"item {i} of type {type(item).__name__}: give MultimodalItem objects")
        if item.start < prev_end:
            raise ValueError(
                f"item {i} at [{item.start}, {item.end}) overlaps or precedes the item before it (ending at "
                f"{prev_end}): give items in prompt order, disjoint"
            )
        if item.end > len(ids):
            raise ValueError(
                f"item {i} at [{item.start}, {item.end}) ends past the prompt's {len(ids)} tokens: give positions "
                "inside the prompt"
            )
        wrong = next((p for p in range(item.start, item.end) if ids[p] != placeholder_token_id), None)
        if wrong is not None:
            raise ValueError(
                f"item {i} at [{item.start}, {item.end}) covers position {wrong}, which holds {ids[wrong]}, not "
                f"the placeholder {placeholder_token_id}: give the item's placeholder positions"
            )
        prev_end = item.end
        covered += item.num_tokens
    total = sum(1 for t in ids if t == placeholder_token_id)
    if total != covered:
        raise ValueError(
            f"the prompt holds {total} placeholder tokens (id {placeholder_token_id}) but the {len(items)} items "
            f"cover {covered}: give one item per image the prompt names"
        )
    for item in items:
        ids[item.start : item.end] = [item.pad_value] * item.num_tokens
    return ids
