"""Pad values: the token id an item's placeholder positions carry in a request's key.

SGLang writes, at every placeholder position of a multimodal item, a value derived from the
item's content hash (``MultimodalDataItem.set_pad_value``), so that the prefix tree, the page
hashes of the host and storage tiers and the KV events see the image's identity: two images
behind the same text are different keys, the same image is the same key and its KV is reused.

The value is SGLang's current ``_compute_pad_value``: ``MM_PAD_SHIFT_VALUE + hash % 2**30``
(``MM_PAD_SHIFT_VALUE = 1_000_000``), in ``[1_000_000, 1_000_000 + 2**30)``: above every text
token id of a vocabulary of at most 1,000,000 ids (:func:`check_vocab_size` refuses a larger one,
as SGLang's ``sanity_check_mm_pad_shift_value``), and inside int32, the tree's key type.

Where kvjax differs: nothing in the value; older SGLang releases used ``hash % 2**30`` alone,
which can equal a text token id (a false prefix hit between an image and text); kvjax follows the
shifted form. As in SGLang, two different items whose hashes agree modulo ``2**30`` get the same
pad value, and then the same key: the chance for two given items is ``2**-30``; the embedding
cache is keyed by the full 64-bit hash and never confuses them.
"""

from __future__ import annotations

__all__ = ["MM_PAD_SHIFT_VALUE", "PAD_VALUE_SPAN", "check_vocab_size", "is_pad_value", "pad_value"]

#: The smallest pad value (SGLang's ``MM_PAD_SHIFT_VALUE``); every text token id is below it.
MM_PAD_SHIFT_VALUE = 1_000_000

#: How many pad values there are: ``2**30``.
PAD_VALUE_SPAN = 1 << 30


def pad_value(item_hash: int) -> int:
    """The pad value of an item of content hash ``item_hash`` (an int >= 0):
    ``MM_PAD_SHIFT_VALUE + item_hash % 2**30``.

    Raises:
        ValueError: ``item_hash`` is not an int >= 0.
    """
    if isinstance(item_hash, bool) or not isinstance(item_hash, int) or item_hash < 0:
        raise ValueError(f"item_hash={item_hash!r}: give an item's content hash, an int >= 0 (hash_item)")
    return MM_PAD_SHIFT_VALUE + item_hash % PAD_VALUE_SPAN


def is_pad_value(token_id: int) -> bool:
    """Whether ``token_id`` is in the pad values' range (never a text token id)."""
    return MM_PAD_SHIFT_VALUE <= token_id < MM_PAD_SHIFT_VALUE + PAD_VALUE_SPAN


def check_vocab_size(vocab_size: int) -> None:
    """Raise ValueError when a vocabulary's ids could equal a pad value (``vocab_size >
    MM_PAD_SHIFT_VALUE``): such a model's image keys could collide with its text."""
    if vocab_size > MM_PAD_SHIFT_VALUE:
        raise ValueError(
            f"vocab_size={vocab_size}: multimodal pad values start at {MM_PAD_SHIFT_VALUE}, so a vocabulary this "
            "large could match them; kvjax serves multimodal models with vocab_size <= 1000000 only"
        )
