"""`ZmqEventPublisher`: KV event batches on a ZMQ PUB socket, with a ROUTER socket that replays
missed ones (vLLM's and SGLang's protocol; needs ``pyzmq`` and ``msgspec``: the ``events`` extra).

Wire protocol:

* **PUB**: every batch is one message of three frames: the topic (UTF-8), the batch's sequence
  number (8 bytes, big-endian, signed; 0, 1, 2, ... per publisher) and the msgpack payload
  (``kvjax.kv_events.wire``). A subscriber that sees a number jump has missed batches.
* **replay ROUTER** (``replay_endpoint``): a client (a REQ or DEALER socket) sends one frame, the
  first sequence number it wants (8 bytes, big-endian); the publisher answers with one
  ``(sequence number, payload)`` message per buffered batch from that number on, in order, then
  the end marker ``(-1 as 8 bytes, b"")``. The buffer keeps the last ``buffer_steps`` batches.

Threads: ``publish`` (the scheduler's thread) only appends the batch to a deque (no lock, no
wake-up, never a wait); with ``max_queue_size`` batches waiting it drops it instead (counted in
``dropped_batches``, before it got a sequence number: subscribers see no gap and miss it). One
background thread owns both sockets: every ``POLL_SECONDS`` (or at once when a replay request
comes) it encodes, numbers, sends and buffers what is queued, in order, and answers replay
requests between batches; its every wait is bounded. ``close()`` lets the thread send what is
queued (at most ``CLOSE_TIMEOUT`` seconds), then closes the sockets (messages already sent may
still leave for ``LINGER_MS``) and the publisher's own ZMQ context.

DP: publisher ``data_parallel_rank`` stamps every batch with it (when the batch has none) and
publishes at ``offset_endpoint(endpoint, rank)``: the tcp port plus the rank, or the address
plus ``_dp{rank}`` (vLLM's rule for inproc; kvjax applies it to ipc as well, where vLLM refuses).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

try:
    import msgspec
    import zmq
except ImportError as e:  # pragma: no cover - the events extra is missing
    raise ImportError("KV events on the wire need msgspec and pyzmq: pip install 'kvjax[events]'") from e

from kvjax.errors import ConfigError
from kvjax.kv_events.config import KVEventsConfig
from kvjax.kv_events.wire import EventBatch

__all__ = ["END_SEQ", "NullEventPublisher", "ZmqEventPublisher", "make_publisher", "offset_endpoint"]

log = logging.getLogger(__name__)

#: The replay's end marker (sequence number -1).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The address DP rank ``rank`` publishes at: ``endpoint`` for rank 0 (or None); else the
    tcp port plus ``rank``, or the address plus ``_dp{rank}`` (inproc, ipc)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ``::``, ipc or inproc address; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class NullEventPublisher:
    """Publishes nothing (``publisher: "null"``)."""

    published_batches = 0
    dropped_batches = 0

    def publish(self, batch: EventBatch) -> None:
        """Drop ``batch``."""

    def close(self) -> None:
        """Nothing to close."""


class ZmqEventPublisher:
    """The PUB / replay-ROUTER publisher (module docstring).

    Args:
        endpoint: the PUB address (bound or connected: ``KVEventsConfig.endpoint``), before the
            DP offset.
        replay_endpoint: the ROUTER address (always bound), before the DP offset; None: no replay.
        buffer_steps: batches kept for replay (>= 1).
        hwm: the PUB socket's send high-water mark (messages; 0: none).
        max_queue_size: batches queued for the thread (>= 1).
        topic: the first frame of every message.
        data_parallel_rank: this publisher's DP rank (offsets the addresses, stamps batches).

    Raises ConfigError naming ``endpoint`` or ``replay_endpoint`` when ZMQ refuses the address
    (in use, malformed); nothing is left open then.
    """

    POLL_SECONDS = 0.005
    CLOSE_TIMEOUT = 2.0
    LINGER_MS = 200  # how long close() lets sent messages still leave

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        data_parallel_rank: int = 0,
    ) -> None:
        self.data_parallel_rank = int(data_parallel_rank)
        self.endpoint = offset_endpoint(endpoint, self.data_parallel_rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, self.data_parallel_rank)
        self._topic = topic.encode("utf-8")
        self._queue: deque[EventBatch] = deque()  # appended here, popped by the thread (atomic)
        self._max_queue = max_queue_size
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, self.LINGER_MS)  # a publisher never closed never blocks its collection
        self._pub: Any = None
        self._replay: Any = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._open(self._pub, "endpoint", self.endpoint, _binds(self.endpoint))  # type: ignore[arg-type]
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._open(self._replay, "replay_endpoint", self.replay_endpoint, True)
        except BaseException:
            self._close_sockets()
            raise
        self.published_batches = 0
        self.published_events = 0
        self.dropped_batches = 0
        self.replays_served = 0
        self._next_seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{self.data_parallel_rank}", daemon=True)
        self._thread.start()

    def _open(self, sock: Any, name: str, address: str, bind: bool) -> None:
        try:
            sock.bind(address) if bind else sock.connect(address)
        except zmq.ZMQError as e:
            raise ConfigError(
                name, address, f"ZMQ cannot {'bind' if bind else 'connect'} it ({e}); give another address"
            ) from None

    # --- the scheduler's side ---------------------------------------------------------------------

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending (stamped with this publisher's DP rank when it has none),
        never waiting: with ``max_queue_size`` batches queued already it is dropped instead
        (``dropped_batches``). Raises RuntimeError after ``close()``."""
        if not self._running:
            raise RuntimeError("publish: the KV event publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        if len(self._queue) >= self._max_queue:
            self.dropped_batches += 1
            log.warning("KV events: publisher queue full; a batch of %d events dropped", len(batch.events))
            return
        self._queue.append(batch)

    def wait_sent(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Wait (at most ``timeout`` seconds) until the thread has sent every batch queued so far
        (each is then in the replay buffer too); True when it has. For tests and an orderly hand-over:
        ``publish`` itself never waits."""
        deadline = time.monotonic() + timeout
        while self._queue:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return not self._queue
            time.sleep(self.POLL_SECONDS)
        return True

    def close(self) -> None:
        """Send what is queued (at most ``CLOSE_TIMEOUT`` seconds), stop the thread, close the
        sockets and the context. Idempotent."""
        if not self._running:
            return
        self._running = False
        self._thread.join(self.CLOSE_TIMEOUT + 1.0)
        if self._thread.is_alive():
            log.warning("KV events: publisher thread still busy after %.1f s; closing its sockets", self.CLOSE_TIMEOUT)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=self.LINGER_MS)
        self._ctx.term()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the thread's side ------------------------------------------------------------------------

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        pending = self._queue
        deadline: float | None = None
        while True:
            if self._replay is not None:
                # the thread's one wait: a replay request, or POLL_SECONDS for batches to gather
                if self._replay.poll(0 if pending else int(self.POLL_SECONDS * 1000)):
                    try:
                        self._serve_replay()
                    except zmq.ZMQError as e:  # a client gone mid-answer: the stream goes on
                        log.warning("KV events: a replay request failed: %s", e)
            elif not pending:
                time.sleep(self.POLL_SECONDS)
            if not self._running:
                if not pending:
                    return
                deadline = deadline or time.monotonic() + self.CLOSE_TIMEOUT
                if time.monotonic() > deadline:  # closing: drain, but within the time close() waits
                    return
            while pending:
                batch = pending.popleft()
                try:
                    payload = encode(batch)
                    seq = self._next_seq
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big", signed=True), payload), copy=False)
                    self._next_seq = seq + 1
                    self._buffer.append((seq, payload))
                    self.published_batches += 1
                    self.published_events += len(batch.events)
                except (zmq.ZMQError, msgspec.EncodeError, TypeError) as e:
                    self.dropped_batches += 1
                    log.error("KV events: a batch could not be sent: %s", e)

    def _serve_replay(self) -> None:
        """Answer one replay request: the buffered batches from its sequence number, then the end."""
        frames = self._replay.recv_multipart()
        if len(frames) < 2 or len(frames[-1]) != 8:
            log.warning("KV events: malformed replay request of %d frames ignored", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[-1], "big", signed=True)
        envelope = [identity, b""] if len(frames) == 3 else [identity]  # REQ clients add a delimiter
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([*envelope, seq.to_bytes(8, "big", signed=True), payload])
        self._replay.send_multipart([*envelope, END_SEQ, b""])
        self.replays_served += 1


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config`` describes for DP rank ``data_parallel_rank``."""
    if not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(
        config.endpoint,
        config.replay_endpoint,
        buffer_steps=config.buffer_steps,
        hwm=config.hwm,
        max_queue_size=config.max_queue_size,
        topic=config.topic,
        data_parallel_rank=data_parallel_rank,
    )
