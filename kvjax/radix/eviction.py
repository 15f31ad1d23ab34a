"""Eviction policies: priority functions over tree nodes, chosen by name.

A policy maps a node to a comparable priority; the tree evicts the evictable leaf with the
*smallest* priority first (SGLang's convention). Times are the tree's logical clock (an int that
ticks once per tree operation and once per node created), not wall time, so runs are
deterministic and ties between leaves do not occur in practice.

Lazy heaps. The tree keeps one persistent heap of evictable leaves. A heap entry records the
priority the node had when it was pushed. For a policy whose priority never becomes *more
urgent* (smaller) after the push — ``monotone = True`` — an entry can be left stale: when it
reaches the top, the tree recomputes the priority and re-pushes the node if it grew. That is
exact, because a stale entry can only sit *earlier* than it should. ``mru`` breaks that rule (an
access makes a node more urgent), so it is marked ``monotone = False`` and the tree pushes a
fresh entry every time it touches an evictable leaf; older entries are discarded by sequence
number. ``fifo``/``filo`` never change after creation; ``lru``, ``lfu``, ``priority`` and
``slru`` only grow (access time, hit count and per-node priority only increase).

Retention (``retention.py``) is a tier above every policy, not a policy: nodes a request retained
are evicted after every other candidate until the retention clock passes their expiry; the heap
keeps the tiers (``eviction_heap.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from kvjax.errors import ConfigError

if TYPE_CHECKING:
    from kvjax.radix.node import TreeNode


class EvictionPolicy:
    """A named priority function. Smaller priority = evicted first.

    Attributes:
        name: the policy's name (``--radix-eviction-policy`` value).
        monotone: True if a node's priority can only grow (become less urgent) over its life;
            only then may the tree's heap hold stale entries (see the module docstring).
        uses_hit_count: True if the priority reads ``hit_count`` (the tree then keeps hit
            counts exact on every path it walks, at O(depth) per request-lifecycle call).
    """

    name: str = ""
    monotone: bool = True
    uses_hit_count: bool = False

    def priority(self, node: TreeNode) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRUPolicy(EvictionPolicy):
    """Least recently used first: ``last_access``."""

    name = "lru"

    def priority(self, node: TreeNode) -> int:
        return node.last_access


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, then least recently: ``(hit_count, last_access)``."""

    name = "lfu"
    uses_hit_count = True

    def priority(self, node: TreeNode) -> tuple[int, int]:
        return (node.hit_count, node.last_access)


class FIFOPolicy(EvictionPolicy):
    """Oldest node first: ``creation``."""

    name = "fifo"

    def priority(self, node: TreeNode) -> int:
        return node.creation


class MRUPolicy(EvictionPolicy):
    """Most recently used first: ``-last_access``. Not monotone (an access makes a node more
    urgent), so the tree re-pushes a leaf on every access instead of keeping stale entries."""

    name = "mru"
    monotone = False

    def priority(self, node: TreeNode) -> int:
        return -node.last_access


class FILOPolicy(EvictionPolicy):
    """Newest node first: ``-creation``."""

    name = "filo"

    def priority(self, node: TreeNode) -> int:
        return -node.creation


class PriorityPolicy(EvictionPolicy):
    """Lowest request priority first, then LRU: ``(priority, last_access)``.

    A node's priority is the max over the requests that inserted through it; a split node
    inherits its child's priority.
    """

    name = "priority"

    def priority(self, node: TreeNode) -> tuple[int, int]:
        return (node.priority, node.last_access)


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: nodes hit fewer than ``protected_threshold`` times (probationary) go
    before the protected ones, LRU inside each segment: ``(hit_count >= t, last_access)``."""

    name = "slru"
    uses_hit_count = True

    def __init__(self, protected_threshold: int = 2) -> None:
        if int(protected_threshold) < 1:
            raise ConfigError(
                "radix_eviction_policy_config.protected_threshold",
                protected_threshold,
                "use an integer >= 1 (SGLang's default is 2)",
            )
        self.protected_threshold = int(protected_threshold)

    def priority(self, node: TreeNode) -> tuple[int, int]:
        return (1 if node.hit_count >= self.protected_threshold else 0, node.last_access)

    def __repr__(self) -> str:
        return f"SLRUPolicy(protected_threshold={self.protected_threshold})"


EVICTION_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
    "mru": MRUPolicy,
    "filo": FILOPolicy,
    "priority": PriorityPolicy,
    "slru": SLRUPolicy,
}


# Policies whose priority is node attributes as they are (an int, or a tuple of them): the tree
# calls a C-level ``attrgetter`` for them, ~3x cheaper than the Python method (a push and a pop
# per evicted leaf). Exact classes only: a subclass may override ``priority``.
_ATTRIBUTE_PRIORITIES: dict[type, tuple[str, ...]] = {
    LRUPolicy: ("last_access",),
    LFUPolicy: ("hit_count", "last_access"),
    FIFOPolicy: ("creation",),
    PriorityPolicy: ("priority", "last_access"),
}


def priority_function(policy: EvictionPolicy) -> Callable[[TreeNode], Any]:
    """``policy.priority``, or a C-level function returning the same values for the built-in
    policies whose priority is plain node attributes."""
    attrs = _ATTRIBUTE_PRIORITIES.get(type(policy))
    return attrgetter(*attrs) if attrs else policy.priority


def get_eviction_policy(name: str | EvictionPolicy, **config: Any) -> EvictionPolicy:
    """The policy called ``name`` (case-insensitive), built with ``config`` as keyword args.

    An :class:`EvictionPolicy` instance is returned as is.

    Raises:
        ConfigError: unknown name (the message lists the valid ones) or bad config.
    """
    if isinstance(name, EvictionPolicy):
        return name
    key = str(name).strip().lower()
    factory = EVICTION_POLICIES.get(key)
    if factory is None:
        raise ConfigError(
            "radix_eviction_policy",
            name,
            f"use one of {', '.join(sorted(EVICTION_POLICIES))}",
        )
    try:
        return factory(**config)
    except TypeError as exc:
        raise ConfigError("radix_eviction_policy_config", config, f"{key} does not take these: {exc}") from exc
