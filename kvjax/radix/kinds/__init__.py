"""The host layer's registration of each cache kind (`HostKind`: its trees, allocator and request
table). The built-in kinds with host-side state of their own are one module each (``full``,
``swa``, ``recurrent``); the others (MLA, the host tier, the request table, the retraction backup)
take the defaults and register an empty ``HostKind``. All are registered on import."""

from __future__ import annotations

from kvjax.kinds.names import HOST_TIER, MLA, REQUEST_TABLE, RETRACTION
from kvjax.radix.kinds import full, recurrent, swa
from kvjax.radix.kinds.host_kind import HOST_KINDS, HostKind, TreeBuilder, host_kind, register_host_kind

__all__ = ["HOST_KINDS", "HostKind", "TreeBuilder", "host_kind", "register_host_kind"]

for _kind in (
    HostKind(REQUEST_TABLE),
    full.KIND,
    HostKind(MLA),
    swa.KIND,
    recurrent.KIND,
    HostKind(HOST_TIER),
    HostKind(RETRACTION),
):
    register_host_kind(_kind)
del _kind
