"""KV cache events for cache-aware routers: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared`` (the vLLM/SGLang event vocabulary), and the chained page hash.

Block hashes. Page ``j`` of a path hashes ``(hash of page j-1, page tokens)``: by default with
SHA-256 truncated to a signed int64 (``kvjax.page_hash.PageHasher``), the chain starting from a
seed mixed with the key's namespace (``extra_key``), so equal tokens under different namespaces
hash differently, and a page's hash depends on its position in the sequence. A tree may carry
another chained hash instead (``tree.start_events(sink, hasher)``: vLLM's ``sha256_cbor``, whose
stored hashes are 32-byte digests; ``kvjax.kv_events``). A node stores its pages' hashes when it
is created; a split cuts that list at the page boundary, so hashes never change across splits.

One ``BlockStored`` is emitted per new node and carries all of its pages (``block_hashes``,
``token_ids`` of ``block_size * len(block_hashes)`` tokens); one ``BlockRemoved`` per evicted node.
``medium`` says which copy: ``"device"`` (the tree core), ``"host"`` (the host tier's landed copies
and their eviction) or ``"storage"`` (the storage tier's landed writes). ``kvjax.kv_events`` puts
them on the wire for fleet routers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BlockStored:
    """Pages newly cached in ``medium``.

    Attributes:
        block_hashes: one chained hash per page, in order (the tree hasher's stored form).
        parent_block_hash: hash of the page before the first one (None at the start of a key).
        token_ids: the pages' tokens (key elements; bigram keys list the covered tokens).
        block_size: tokens per page.
        extra_key: the key namespace (LoRA id / cache salt), None for the default one.
        medium: where the blocks live: "device", "host" or "storage" (SGLang's "GPU",
            "CPU_TIER1", "CPU_TIER2" on the wire).
    """

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    extra_key: Hashable = None
    medium: str = "device"


@dataclass(frozen=True)
class BlockRemoved:
    """Pages no longer cached in ``medium`` (their hashes, as stored)."""

    block_hashes: list[Any]
    medium: str = "device"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[KVEvent], Any] | list


@dataclass
class EventQueue:
    """Delivers events to ``sink`` (a callable or a list), or queues them for ``take()``."""

    sink: EventSink | None = None
    pending: list = field(default_factory=list)

    def emit(self, event: KVEvent) -> None:
        sink = self.sink
        if sink is None:
            self.pending.append(event)
        elif isinstance(sink, list):
            sink.append(event)
        else:
            sink(event)

    def take(self) -> list:
        out, self.pending = self.pending, []
        return out
