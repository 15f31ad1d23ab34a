"""`cached_blocks`: the pages a tree caches, per medium, as its KV events name them; the set a
subscriber of the tree's event stream must hold (jax-free; the tests' and the benchmark's
reference).

A page counts in medium ``"device"`` while its node holds device slots, in ``"host"`` while its
node's host copy has landed and been reported (``HostData.announced``; a pending backup is not on
the host yet), and in ``"storage"`` once a storage write of it landed (``StorageLink.
reported_pages``; the store keeps pages past the tree's nodes, until a reset). Hashes are the wire
form (``hasher.wire_hash``).
"""

from __future__ import annotations

from typing import Any

from kvjax.kv_events.media import WIRE_MEDIUM

__all__ = ["cached_blocks"]


def cached_blocks(tree: Any, *, wire_media: bool = True) -> set[tuple[str, int | bytes]]:
    """Every ``(medium, block hash)`` ``tree`` caches (module docstring); ``wire_media``: the
    wire's medium names (``"GPU"``, ``"CPU_TIER1"``), else kvjax's (``"device"``, ``"host"``).
    O(pages). Raises ValueError for a tree whose events are off (its nodes carry no hashes)."""
    if not getattr(tree, "enable_kv_cache_events", False):
        raise ValueError("cached_blocks: the tree's KV events are off; its nodes carry no page hashes")
    wire = tree.block_hasher.wire_hash
    try:
        host = tree.component("host")
    except KeyError:
        host = None
    names = {m: (WIRE_MEDIUM[m] if wire_media else m) for m in ("device", "host", "storage")}
    device_name, host_name = names["device"], names["host"]
    out: set[tuple[str, int | bytes]] = set()
    storage = getattr(tree, "storage", None)
    out.update((names["storage"], wire(h)) for h in getattr(storage, "reported_pages", ()))
    for node in tree.nodes():
        hashes = [wire(h) for h in node.hashes or ()]
        if node.value is not None:
            out.update((device_name, h) for h in hashes)
        if host is not None:
            data = host.data(node)
            if data is not None and data.announced:
                out.update((host_name, h) for h in hashes)
    return out
