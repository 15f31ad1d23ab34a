"""`EventSubscriber`: the client side of the KV event stream: a ZMQ SUB socket, gap detection by
sequence number and recovery through the publisher's replay socket (vLLM's
``examples/online_serving/kv_events_subscriber.py`` protocol; needs ``pyzmq`` and ``msgspec``).

``receive(timeout)`` returns the batches that arrived, in sequence order, each once: when a
message's sequence number skips past the next one expected, the missing ones are asked of the
replay socket first (a DEALER request of the first missing number, the empty delimiter frame
first as a REQ socket sends it; answers until the end marker,
every wait bounded by ``replay_timeout``). Batches the replay no longer holds are counted in
``lost_batches``; a subscriber that lost batches cannot know the cache and should wait for an
``AllBlocksCleared`` or rebuild from a fresh server.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from kvjax.kv_events.publisher import END_SEQ
from kvjax.kv_events.wire import KVEventBatch

__all__ = ["EventSubscriber"]


class EventSubscriber:
    """A SUB client of one publisher (module docstring).

    Args:
        endpoint: the publisher's PUB address as a client reaches it (``tcp://host:port``).
        replay_endpoint: its replay ROUTER address (None: gaps are only counted).
        topic: the topic prefix to subscribe to ("" : every message).
        batch_type: the struct the payload is decoded as (default kvjax's ``KVEventBatch``).
        replay_timeout: seconds to wait for each replay answer.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        batch_type: Any = KVEventBatch,
        replay_timeout: float = 2.0,
    ) -> None:
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # closing (or collecting) never waits on a gone publisher
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._decode = msgspec.msgpack.Decoder(type=batch_type).decode
        self._timeout_ms = int(replay_timeout * 1000)
        self.last_seq = -1
        self.lost_batches = 0
        self.replayed_batches = 0

    def receive(self, timeout: float = 0.0) -> list[tuple[int, Any]]:
        """The ``(sequence number, batch)`` pairs that arrived, waiting up to ``timeout`` seconds
        for the first; gaps filled from the replay socket (module docstring)."""
        out: list[tuple[int, Any]] = []
        wait = int(timeout * 1000)
        while self._sub.poll(wait):
            wait = 0
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq <= self.last_seq:
                continue  # replayed already
            if seq > self.last_seq + 1:
                out.extend(self.replay(self.last_seq + 1, seq))
            if seq > self.last_seq + 1:
                self.lost_batches += seq - self.last_seq - 1
            out.append((seq, self._decode(payload)))
            self.last_seq = seq
        return out

    def replay(self, start: int, stop: int | None = None) -> list[tuple[int, Any]]:
        """Ask the replay socket for the batches from ``start`` (before ``stop``); those it still
        holds, in order (``last_seq`` advances over them)."""
        if self._replay_endpoint is None:
            return []
        # A DEALER, not vLLM's REQ: the answer is many messages and a REQ socket keeps the first.
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self._replay_endpoint)
        out: list[tuple[int, Any]] = []
        try:
            req.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while req.poll(self._timeout_ms):
                _, seq_bytes, payload = req.recv_multipart()
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq <= self.last_seq or (stop is not None and seq >= stop):
                    continue
                if seq > self.last_seq + 1:
                    self.lost_batches += seq - self.last_seq - 1
                out.append((seq, self._decode(payload)))
                self.last_seq = seq
                self.replayed_batches += 1
        finally:
            req.close(linger=0)
        return out

    def close(self) -> None:
        """Close the socket and the subscriber's context."""
        self._ctx.destroy(linger=0)
