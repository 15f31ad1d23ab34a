"""The built-in cache kinds' names: the key that joins a kind's registrations across the layers.

A cache kind is one kind of cached state (full attention, MLA, the sliding-window pair, recurrent
state, the host tier, the request table, the ``cpu_tensor`` retraction backup). Each layer that
acts on cached state registers, under the kind's name, what it does for the kind
(``kvjax.kinds.registry``); this module is the only place outside a kind's own files that spells
the built-in names.
"""

from __future__ import annotations

__all__ = ["BUILTIN_KINDS", "FULL", "HOST_TIER", "MLA", "RECURRENT", "REQUEST_TABLE", "RETRACTION", "SWA"]

REQUEST_TABLE = "request_table"
"""The request -> token-slot table (``ReqToTokenPool``); every plan has one."""
FULL = "full"
"""Full attention (MHA / GQA): the paged K/V pool ``"kv"``."""
MLA = "mla"
"""Multi-head latent attention: the latent pool (and DSA indexer keys)."""
SWA = "swa"
"""The sliding-window pair: ``"kv_full"`` and ``"kv_swa"`` under the SWA allocator."""
RECURRENT = "recurrent"
"""SSM / linear-attention state: one slot per request."""
HOST_TIER = "host_tier"
"""HiCache's host-memory tier: host copies of the device KV."""
RETRACTION = "retraction"
"""The ``cpu_tensor`` decode retraction backup: a retracted request's pages copied to the host."""

BUILTIN_KINDS = (REQUEST_TABLE, FULL, MLA, SWA, RECURRENT, HOST_TIER, RETRACTION)
"""The built-in kinds in their fixed order (every layer registers them in this order)."""
