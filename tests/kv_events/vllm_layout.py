"""A subscriber written against vLLM's published event layout, independently of ``kvjax.kv_events``:
the structs as vLLM declares them (``vllm/distributed/kv_events.py`` of the versions whose
events are array-like, with ``medium`` and the later optional fields), decoded from a real ZMQ SUB
socket, with gaps filled through the replay socket as vLLM's example subscriber does. `Mirror`
rebuilds a server's cached block set from the stream alone."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM's example subscriber's older, shorter layout (six BlockStored fields, no DP rank).
class OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldKVEventBatch(OldEventBatch):
    events: list[OldBlockStored | OldBlockRemoved | AllBlocksCleared]


END = (-1).to_bytes(8, "big", signed=True)


class Mirror:
    """One stream's subscriber: the ``(medium, hash)`` set it rebuilt, its last sequence number."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self.ctx = zmq.Context()
        # Every socket of this context drops what it still has to send when closed (a subscription
        # to a publisher that is gone included), so closing, or collecting, it never blocks.
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.blocks: set[tuple[str | None, Any]] = set()
        self.last_seq = -1
        self.replayed = 0
        self.ranks: set[int | None] = set()
        self.batches = 0

    def apply(self, batch: KVEventBatch) -> None:
        self.batches += 1
        self.ranks.add(batch.data_parallel_rank)
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                self.blocks.update((e.medium, h) for h in e.block_hashes)
            elif isinstance(e, BlockRemoved):
                missing = {(e.medium, h) for h in e.block_hashes} - self.blocks
                assert not missing, f"removal of blocks never stored: {list(missing)[:3]}"
                self.blocks.difference_update((e.medium, h) for h in e.block_hashes)
            else:
                self.blocks.clear()

    def replay_from(self, start: int) -> None:
        """Ask the replay ROUTER for the batches from ``start``. A DEALER socket (an empty
        delimiter frame first, as a REQ socket would send): the answer is many messages, and a
        REQ socket keeps only the first (vLLM's example subscriber uses one)."""
        req = self.ctx.socket(zmq.DEALER)
        assert self.replay_endpoint is not None
        req.connect(self.replay_endpoint)
        req.send_multipart([b"", start.to_bytes(8, "big")])
        try:
            while req.poll(2000):
                _, seq_bytes, payload = req.recv_multipart()
                if seq_bytes == END:
                    return
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == self.last_seq + 1:
                    self.apply(self.decoder.decode(payload))
                    self.last_seq = seq
                    self.replayed += 1
            raise AssertionError("replay: no end marker within 2 s")
        finally:
            req.close(linger=0)

    def drain(self, timeout_ms: int = 200, *, replay_tail: bool = True) -> None:
        """Receive until the stream is quiet for ``timeout_ms``, replaying over any gap; then
        (``replay_tail``) ask the replay socket for anything after the last batch seen (a
        subscriber that joined late saw none of the batches sent before its subscription
        reached the publisher)."""
        self._receive(timeout_ms)
        if replay_tail:
            self.replay_from(self.last_seq + 1)

    def _receive(self, timeout_ms: int) -> None:
        while self.sub.poll(timeout_ms):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                self.replay_from(self.last_seq + 1)
            assert seq == self.last_seq + 1, f"gap {self.last_seq} -> {seq} not filled by the replay"
            self.apply(self.decoder.decode(payload))
            self.last_seq = seq

    def close(self) -> None:
        self.ctx.destroy(linger=0)
