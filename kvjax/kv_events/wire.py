"""The KV events' wire structs: vLLM's layout, which SGLang, llm-d's kv-cache-manager and
NVIDIA Dynamo's KV router decode (needs ``msgspec``: the ``events`` extra).

A message's payload is a `KVEventBatch` encoded with ``msgspec.msgpack``. Every struct is
declared as vLLM declares it, ``array_like`` (a msgpack array of its fields, in declaration
order; msgspec writes every field of an array-like struct, defaults included, whatever
``omit_defaults`` says) and tagged for events, so an event is ``[tag, field, ...]`` with the class
name as the tag::

    [ts, [["BlockStored", [h0, h1], parent, [t0, ...], block_size, lora_id, medium, lora_name,
           extra_keys, group_idx], ["BlockRemoved", [h0], medium, group_idx], ...], dp_rank]

Field order is vLLM's: ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, group_idx)``; a decoder that declares fewer fields (the
older six-field ``BlockStored`` of vLLM's example subscriber, SGLang's five) ignores the trailing
ones (msgspec's array decoding), and a decoder declaring more fields with defaults reads them. Block
hashes are ints (kvjax's int64, or vLLM's ``sha256_cbor`` as the unsigned low 64 bits of the
digest) or bytes (the whole digest), as vLLM's ``ExternalBlockHash``.

Media (``medium``) are SGLang's names: ``"GPU"`` (the accelerator's memory: a TPU's HBM here),
``"CPU_TIER1"`` (the host tier) and ``"CPU_TIER2"`` (the storage tier); `WIRE_MEDIUM` maps
kvjax's in-process names (``"device"``, ``"host"``, ``"storage"``) to them.
"""

from __future__ import annotations

from typing import Any

try:
    import msgspec
except ImportError as e:  # pragma: no cover - the events extra is missing
    raise ImportError("KV events on the wire need msgspec and pyzmq: pip install 'kvjax[events]'") from e

from kvjax.kv_events.media import WIRE_MEDIUM

__all__ = [
    "WIRE_MEDIUM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventBatch",
]

BlockHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's payload: a timestamp (seconds since the epoch), the events, and the DP rank
    whose cache they describe (None: left out, one rank)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Pages newly cached in ``medium``: ``block_hashes[i]`` covers
    ``token_ids[i * block_size : (i + 1) * block_size]``, chained from ``parent_block_hash``
    (None at a sequence's start). ``extra_keys``: per block, what entered its hash besides the
    tokens (the cache salt on a sequence's first block), or None."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Pages no longer cached in ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every page of every medium is gone (the cache was reset)."""


class KVEventBatch(EventBatch):
    """`EventBatch` with its events' types (what a subscriber decodes with)."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
