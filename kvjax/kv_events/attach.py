"""`attach_events`: a tree's KV events published as ``KVEventsConfig`` says (needs ``msgspec``,
and ``pyzmq`` for the ``"zmq"`` publisher).

It builds the hasher the configuration names (``block_hash``: ``"kvjax"`` keeps the tree's own
``PageHasher``), the publisher (one per DP rank, at the rank's offset addresses) and an
`EventBridge`, and turns the tree's events on into the bridge (``tree.start_events``; the tree
must cache nothing yet). The caller flushes the bridge once per scheduler step
(``kvjax.serve.kv_events`` does) and closes it at the end.
"""

from __future__ import annotations

from typing import Any

from kvjax.kv_events.block_hash import make_block_hasher
from kvjax.kv_events.bridge import EventBridge
from kvjax.kv_events.config import KVEventsConfig
from kvjax.kv_events.publisher import make_publisher

__all__ = ["attach_events"]


def attach_events(
    tree: Any, config: KVEventsConfig, *, data_parallel_rank: int = 0, publisher: Any = None
) -> EventBridge:
    """Publish ``tree``'s KV events per ``config`` as DP rank ``data_parallel_rank``'s stream;
    ``publisher``: one of the caller's own instead of the configuration's.

    A tree without prefix caching (a chunk cache: no ``start_events``) gets a bridge that never
    has anything to publish, as vLLM publishes nothing without prefix caching.

    Raises (nothing left open): ConfigError for a ``sha256_cbor`` hash without a seed or an
    address ZMQ refuses; ValueError for a tree that caches prefixes already.
    """
    start = getattr(tree, "start_events", None)
    hasher = make_block_hasher(config.block_hash, config.hash_seed)
    if hasher is None and start is not None:
        hasher = tree.block_hasher
    pub = make_publisher(config, data_parallel_rank) if publisher is None else publisher
    bridge = EventBridge(pub, hasher, data_parallel_rank=data_parallel_rank)
    if start is not None:
        try:
            start(bridge, hasher)
        except BaseException:
            pub.close()
            raise
    return bridge
