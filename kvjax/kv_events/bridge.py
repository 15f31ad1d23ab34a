"""`EventBridge`: a tree's in-process KV events (``kvjax.radix.events``) turned into wire events
(``kvjax.kv_events.wire``), one `KVEventBatch` per scheduler step (needs ``msgspec``).

The bridge is the tree's event sink (``tree.start_events(bridge, hasher)``): it only appends each
event to a list; ``flush()`` (once per scheduler step) converts them and hands the publisher one
batch, or nothing when the step changed no cached page. Conversion, per event:

* hashes: ``hasher.wire_hash`` of each stored hash (kvjax: the int64 itself; ``sha256_cbor``: the
  digest's low 64 bits, or the digest);
* ``medium``: ``WIRE_MEDIUM`` (``"device"`` -> ``"GPU"``, ``"host"`` -> ``"CPU_TIER1"``,
  ``"storage"`` -> ``"CPU_TIER2"``);
* ``token_ids``: ``block_size`` per block (a bigram key's extra token is dropped);
* ``lora_id`` / ``lora_name``: None (kvjax has no LoRA); ``extra_keys``: ``[(extra_key,), None,
  ...]`` for a sequence's first node under a cache salt (``extra_key``), else left out.

Invariant: the batches, applied in order, give a subscriber the tree's cached pages per medium
(``kvjax.kv_events.blocks.cached_blocks``) as of the last flush.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvjax.kv_events.wire import WIRE_MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvjax.page_hash import BlockHasher, PageHasher
from kvjax.radix import events as tree_events

__all__ = ["EventBridge"]


class EventBridge:
    """A tree's event sink that publishes one batch per ``flush`` (module docstring).

    Args:
        publisher: where batches go (``publish(batch)``, ``close()``).
        hasher: the hasher the tree's events carry hashes of (its ``wire_hash`` converts them).
        data_parallel_rank: stamped on every batch (None: the publisher stamps its own).
        clock: the batches' timestamp source (seconds since the epoch).

    Attributes:
        published_events / published_batches: what ``flush`` handed the publisher.
    """

    def __init__(
        self,
        publisher: Any,
        hasher: BlockHasher,
        *,
        data_parallel_rank: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.publisher = publisher
        self.hasher = hasher
        self.data_parallel_rank = data_parallel_rank
        self.clock = clock
        self.pending: list[tree_events.KVEvent] = []
        self._same = getattr(hasher, "wire_hash", None) is PageHasher.wire_hash
        self.published_events = 0
        self.published_batches = 0

    def __call__(self, event: tree_events.KVEvent) -> None:
        """The tree's sink: keep ``event`` for the next ``flush`` (O(1))."""
        self.pending.append(event)

    def flush(self) -> int:
        """Convert the pending events and publish them as one batch; returns the events sent
        (0: nothing pending, nothing published)."""
        events, self.pending = self.pending, []
        if not events:
            return 0
        wire = [self.convert(e) for e in events]
        self.publisher.publish(KVEventBatch(ts=self.clock(), events=wire, data_parallel_rank=self.data_parallel_rank))
        self.published_events += len(wire)
        self.published_batches += 1
        return len(wire)

    def convert(self, event: tree_events.KVEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
        """One in-process event as its wire struct."""
        wire_hash = self.hasher.wire_hash
        same = self._same  # the stored hashes are the wire's: the event's lists are sent as they are
        if isinstance(event, tree_events.BlockStored):
            n = len(event.block_hashes)
            parent = event.parent_block_hash
            extra = None
            if parent is None and event.extra_key is not None and event.extra_key != "":
                extra = [(event.extra_key,)] + [None] * (n - 1)
            tokens = event.token_ids
            if len(tokens) != n * event.block_size:  # a bigram key's extra token
                tokens = tokens[: n * event.block_size]
            return BlockStored(
                block_hashes=list(event.block_hashes) if same else [wire_hash(h) for h in event.block_hashes],
                parent_block_hash=parent if parent is None or same else wire_hash(parent),
                token_ids=tokens,
                block_size=event.block_size,
                lora_id=None,
                medium=WIRE_MEDIUM.get(event.medium, event.medium),
                lora_name=None,
                extra_keys=extra,
            )
        if isinstance(event, tree_events.BlockRemoved):
            return BlockRemoved(
                block_hashes=list(event.block_hashes) if same else [wire_hash(h) for h in event.block_hashes],
                medium=WIRE_MEDIUM.get(event.medium, event.medium),
            )
        return AllBlocksCleared()

    def close(self) -> None:
        """Flush what is pending, then close the publisher."""
        self.flush()
        self.publisher.close()
