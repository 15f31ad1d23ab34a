"""Retention: a request asks the tree to keep its prefix for a while, as a bias, never a pin.

A request with ``retention_seconds`` (and its ``priority``) marks every node it inserts through
(its cached prefix, through the last page it inserted) as *retained* until ``now +
retention_seconds`` on the tree's retention clock. The shape is SGLang's open soft-retention
design (``priority`` with a ``retention_seconds`` that decays), after the hard pin it replaced
was reverted: a pinned prefix can leave the pool with nothing evictable and deadlock the server.

Rules (every eviction policy; ``eviction_heap.py`` keeps them in O(log n) per evicted node):

* Eviction order: unretained and expired nodes first, by the policy; retained, unexpired nodes
  only when nothing else is left to evict, the lowest retention priority first, then by the
  policy. Retention never blocks an allocation: a retained node stays evictable (only a lock
  keeps a node, as before), it is merely evicted last.
* Decay: a node is retained while ``retain_until > now``; once the clock reaches
  ``retain_until`` it is an ordinary node again (its retention fields stay, inert).
* Merging: several retained requests through a node keep the max priority and the latest
  expiry; a request retaining a node whose retention already lapsed starts a fresh one. A split
  copies the retention to both halves (both were inserted through).
* The clock: seconds, logical and supplied by the serving loop (``advance_retention_clock``),
  never read by the tree itself, so every process of a multi-process run that is given the same
  agreed reading makes the same decisions. It never runs backwards (an earlier reading is
  ignored). A standalone tree starts at 0.0 and stays there until a caller advances it.

Where kvjax differs from SGLang's design (a decayed *priority* under the ``priority`` policy
only, its window measured from the node's last access): here retention is a tier above every
policy, and its window is measured from the retaining request's insert; a later hit by a
request without retention does not extend it (a retained request's own hit does: latest
expiry). Priorities are any integers (SGLang clamps them to [0, 99]); ``retention_seconds``
must be finite and >= 0 (0 retains nothing).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvjax.radix.node import NO_RETENTION, TreeNode
from kvjax.request import check_retention_seconds, finite_seconds

__all__ = [
    "NO_RETENTION",
    "check_clock_reading",
    "check_retention_seconds",
    "merge_retention",
    "retained_last",
    "retention_key",
]


def check_clock_reading(value: Any) -> float:
    """A retention clock reading as a finite float. Raises ValueError naming the value otherwise."""
    return finite_seconds(value, "retention clock reading", "give a finite number of seconds")


def merge_retention(node: TreeNode, priority: int, until: float, now: float) -> bool:
    """Record a retention ``(priority, until)`` on ``node`` at clock ``now`` (``until > now``).

    A node retained at ``now`` keeps the max priority and the latest expiry; any other node takes
    the new retention as it is. Returns True when the node's retention priority went *down*
    (a lapsed retention replaced by a lower one): an eviction-heap entry pushed under the old
    priority may then sit too late, and the caller re-queues the node.
    """
    if node.retain_until > now:
        if priority > node.retain_priority:
            node.retain_priority = priority
        if until > node.retain_until:
            node.retain_until = until
        return False
    lowered = priority < node.retain_priority
    node.retain_priority = priority
    node.retain_until = until
    return lowered


def retention_key(node: TreeNode, now: float) -> tuple[int, int]:
    """``(1, retention priority)`` for a node retained at ``now``, else ``(0, 0)``: a prefix for an
    eviction order's key (smaller is evicted first) that puts retained nodes last."""
    if node.retain_until > now:
        return (1, node.retain_priority)
    return (0, 0)


def retained_last(nodes: Iterable[TreeNode], now: float) -> list[TreeNode]:
    """``nodes`` (a component's recency order, most evictable first) with the nodes retained at
    ``now`` moved to the end, lowest retention priority first, in their given order within a
    priority: the retention tier of a component's own eviction order (SWA windows, recurrent
    checkpoints). O(n + r log r) for r retained nodes."""
    plain: list[TreeNode] = []
    kept: list[TreeNode] = []
    for node in nodes:
        (kept if node.retain_until > now else plain).append(node)
    if kept:
        kept.sort(key=_retain_priority)  # stable: the given order within a priority
        plain.extend(kept)
    return plain


def _retain_priority(node: TreeNode) -> int:
    return node.retain_priority
