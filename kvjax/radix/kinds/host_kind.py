"""`HostKind`: what a cache kind builds of host-side state (its trees, its token allocator, its
request table), and the host layer's kind registry (``kvjax.kinds.registry``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvjax.kinds.registry import KindRegistry

if TYPE_CHECKING:
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.plan.tree_options import TreeOptions
    from kvjax.protocols import AllocatorProtocol
    from kvjax.radix.tree_inputs import TreeInputs
    from kvjax.req_pool import ReqToTokenPool

__all__ = ["HOST_KINDS", "HostKind", "TreeBuilder", "host_kind", "register_host_kind"]

TreeBuilder = Callable[["TreeOptions", "TreeInputs"], Any]


@dataclass(frozen=True)
class HostKind:
    """A cache kind's host-side state. Every hook is optional: a kind sets only what it owns.

    Attributes:
        name: the kind's name (the key of its other layers' registrations).
        tree_builders: ``{key: builder}``, the trees the kind builds (``create_tree_cache``): keyed
            by a ``tree_cache_kind`` of its own tree (its planner's ``own_tree``), or by the
            unified tree's components joined with ``"+"`` (``"full+swa"``); a builder takes
            ``(TreeOptions, TreeInputs)``.
        allocator: ``(plan) -> allocator | None``, the token allocator when this kind decides it
            (the first kind of the plan that returns one wins; none: the plain allocator).
        request_table: ``(table, plan) -> table``, the request table this kind needs around the
            plain one (recurrent state: a state slot per request).
    """

    name: str
    tree_builders: Mapping[str, TreeBuilder] = field(default_factory=dict)
    allocator: Callable[[CachePlan], AllocatorProtocol | None] | None = None
    request_table: Callable[[ReqToTokenPool, CachePlan], ReqToTokenPool] | None = None


HOST_KINDS: KindRegistry[HostKind] = KindRegistry("host", "kvjax.radix.kinds.register_host_kind")


def register_host_kind(kind: HostKind) -> HostKind:
    """Add ``kind``'s host-side registration; ``ConfigError`` (nothing changed) when its name or one
    of its tree keys is registered already."""
    if not isinstance(kind, HostKind):
        raise TypeError(f"register_host_kind: expected a HostKind, got {type(kind).__name__}")
    from kvjax.errors import ConfigError

    taken = {key: other.name for other in HOST_KINDS for key in other.tree_builders}
    clash = sorted(key for key in kind.tree_builders if key in taken)
    if clash:
        raise ConfigError(
            "tree_cache_kind", clash[0], f"cache kind {kind.name!r}: the tree is built by {taken[clash[0]]!r}"
        )
    return HOST_KINDS.register(kind.name, kind)


def host_kind(name: str) -> HostKind:
    """Kind ``name``'s host-side registration (``ConfigError`` naming what to do otherwise)."""
    return HOST_KINDS[name]
