"""`attach_kv_events`: a server's KV events on the wire, one batch per scheduler step, one stream
per DP rank (``kvjax.kv_events``; SGLang's ``--kv-events-config``).

Each rank's scheduler gets a `KVEventsExtension` whose ``poll`` (once per scheduler step, before
the batch is formed) publishes what the previous step changed in the rank's tree as one
``KVEventBatch``: the prefixes a finished or chunked request inserted, the pages an eviction
freed, the host tier's landed backups and host evictions. ``KVEventStreams.close()`` publishes
what the last step changed and closes the publishers.

DP: rank ``r`` publishes at the configured addresses offset by ``r`` (vLLM's and SGLang's
per-rank port offset: ``tcp://*:5557`` is rank 0's, ``tcp://*:5558`` rank 1's), its batches
stamped ``data_parallel_rank = r``; a single scheduler is rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvjax.kv_events.attach import attach_events
from kvjax.kv_events.bridge import EventBridge
from kvjax.kv_events.config import KVEventsConfig
from kvjax.serve.extension import ServingExtension

__all__ = ["KVEventStreams", "KVEventsExtension", "attach_kv_events"]


class KVEventsExtension(ServingExtension):
    """Publishes a rank's tree events once per scheduler step (``poll``)."""

    def __init__(self, bridge: EventBridge) -> None:
        self.bridge = bridge

    def poll(self) -> None:
        self.bridge.flush()


@dataclass
class KVEventStreams:
    """The bridges of a server's ranks (rank order)."""

    bridges: Sequence[EventBridge]

    def flush(self) -> int:
        """Publish what is pending on every rank now; returns the events sent."""
        return sum(b.flush() for b in self.bridges)

    @property
    def published_events(self) -> int:
        return sum(b.published_events for b in self.bridges)

    @property
    def published_batches(self) -> int:
        return sum(b.published_batches for b in self.bridges)

    def wait_sent(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout`` seconds per rank) until every rank's publisher has sent what
        it was handed (publishers without ``wait_sent`` count as sent); True when all have."""
        return all(getattr(b.publisher, "wait_sent", lambda t: True)(timeout) for b in self.bridges)

    def close(self) -> None:
        """Publish what is pending, then close every rank's publisher."""
        for b in self.bridges:
            b.close()


def attach_kv_events(
    server: Any, config: KVEventsConfig | str, *, publishers: Sequence[Any] | None = None
) -> KVEventStreams:
    """Publish the KV events of ``server`` (a ``Scheduler``, or a DP front with ``schedulers``:
    ``LockstepDPScheduler``, ``DPScheduler``) per ``config`` (a `KVEventsConfig` or its JSON),
    before it serves anything. ``publishers``: one per rank of the caller's own (tests).

    Raises ConfigError (bad configuration, an address ZMQ refuses) or ValueError (a tree that
    caches prefixes already); the ranks attached before the failing one are closed again.
    """
    if isinstance(config, str):
        config = KVEventsConfig.from_json(config)
    schedulers = list(getattr(server, "schedulers", None) or [server])
    bridges: list[EventBridge] = []
    try:
        for rank, scheduler in enumerate(schedulers):
            publisher = None if publishers is None else publishers[rank]
            bridge = attach_events(scheduler.tree, config, data_parallel_rank=rank, publisher=publisher)
            bridges.append(bridge)
            extension = KVEventsExtension(bridge)
            scheduler.extensions = (*scheduler.extensions, extension)
            extension.attach(scheduler)
    except BaseException:
        for b in bridges:
            b.publisher.close()
        raise
    return KVEventStreams(bridges)
