"""KV events on the wire, in the format fleet routers read (vLLM's, which SGLang, llm-d's
kv-cache-manager and NVIDIA Dynamo's KV router consume); see ``docs/kv_events.md``.

* ``config``: `KVEventsConfig`, SGLang's ``--kv-events-config`` JSON;
* ``wire``: the msgspec structs (``KVEventBatch``, ``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``); ``media``: the media's wire names;
* ``block_hash``: `Sha256CborHasher`, vLLM's ``sha256_cbor`` chained block hash;
* ``publisher``: `ZmqEventPublisher` (PUB + replay ROUTER), one per DP rank;
* ``bridge``: `EventBridge`, a tree's in-process events as one batch per scheduler step;
* ``attach``: `attach_events`, all of it for one tree;
* ``blocks``: `cached_blocks`, the set a subscriber must rebuild;
* ``subscriber`` / ``router``: the client side (`EventSubscriber`, `EventRouter`).

Host layer, jax-free. ``msgspec`` and ``pyzmq`` (the ``events`` extra) are imported only by the
modules that need them, when a name of theirs is first used: importing this package loads none.
"""

from kvjax.lazy import lazy_getattr

_LAZY = {
    "KVEventsConfig": "kvjax.kv_events.config",
    "Sha256CborHasher": "kvjax.kv_events.block_hash",
    "make_block_hasher": "kvjax.kv_events.block_hash",
    "ZmqEventPublisher": "kvjax.kv_events.publisher",
    "NullEventPublisher": "kvjax.kv_events.publisher",
    "make_publisher": "kvjax.kv_events.publisher",
    "EventBridge": "kvjax.kv_events.bridge",
    "attach_events": "kvjax.kv_events.attach",
    "cached_blocks": "kvjax.kv_events.blocks",
    "EventSubscriber": "kvjax.kv_events.subscriber",
    "EventRouter": "kvjax.kv_events.router",
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
