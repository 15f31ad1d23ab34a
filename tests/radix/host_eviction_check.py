"""A checked host eviction for the host-tier state machines.

:func:`check_host_evictions` wraps a tree's ``host.evict_host`` so that every host eviction
(``evict_host``, making room for a backup, ``alloc_held``) is checked against SGLang 0.5.23's
rules, from a snapshot of every host copy before the call:

* the host slots that disappeared are exactly what the call reports freed;
* a copy a transfer uses (pending backup, pending load) or a load-back protects stays;
* write-through policies never free the host copy of a device node;
* write_back frees host copies of device nodes first: a host-only leaf goes only once every
  reclaimable one is gone, and an unlocked device leaf's copy only once every reclaimable
  copy of another device node is gone (the first pass spares device leaves); a call that frees
  less than asked leaves no reclaimable copy behind.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event


def check_host_evictions(tree: Any) -> None:
    """Replace ``tree.host.evict_host`` (instance attribute) by a checked version."""
    host = tree.host
    inner = host.evict_host

    def checked(num_tokens: int) -> int:
        before = {}
        busy = set()
        for node in tree.nodes():
            data = host.data(node)
            if data is None:
                continue
            before[node] = data.slots.copy()
            if data.transfer is not None or data.loading is not None or data.host_ref:
                busy.add(node)
        on_device = {n for n in before if n.value is not None}
        leaves = set(tree.eviction_candidates())
        freed = inner(num_tokens)
        lost = set()
        for node, slots in before.items():
            data = host.data(node)
            if data is None or data.slots.tolist() != slots.tolist():
                lost.add(node)
        assert freed == sum(before[n].size for n in lost), (freed, len(lost))
        assert not lost & busy, "a host copy in use was freed"
        reclaimed = lost & on_device
        if host.write_policy != "write_back":
            assert not reclaimed, "write-through freed the host copy of a device node"
            return freed
        reclaimable = on_device - busy
        if reclaimed:
            event("write_back reclaimed a host copy of a device node")
        if lost - on_device or freed < num_tokens:
            assert reclaimable <= lost, "a host-only leaf went before a reclaimable duplicate"
        if reclaimed & leaves:
            event("write_back reclaimed a device leaf's host copy (second pass)")
            assert reclaimable - leaves <= lost, "a device leaf's copy went in the first pass"
        return freed

    host.evict_host = checked
