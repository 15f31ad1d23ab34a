"""`BeladyPolicy`: the offline optimum's eviction rule, as an eviction policy of kvjax's own tree.

Belady's rule under the radix tree's constraint: only leaves are evicted, and the leaf evicted
first is the one whose next use (``future_use.py``) is farthest in the future; leaves never used
again go first, least recently used first among them. A child's next use is never sooner than its
parent's (a request that reuses a child reuses its whole prefix), so the evicted leaf is also the
farthest of its path.

It plugs into ``RadixCache(eviction_policy=BeladyPolicy(...))`` like any policy: a priority
function (smaller: evicted first). The priority depends on the replay's clock (:attr:`now`, the
index of the request being served), which the replay sets before each request. A leaf's priority
changes only when a request uses it, and a use touches it, so the policy is ``monotone = False``:
the tree re-pushes a leaf at every touch, and an entry is valid until its leaf is touched again.

With unit-size objects and no prefix constraint this is exactly Belady's MIN; with nodes of many
sizes and the leaf constraint it is the natural offline rule, not a proven optimum (the tests
check it against every online policy on real traces, and against libcachesim on a flat trace).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.radix.eviction import EvictionPolicy
from kvjax.replay.future_use import FutureUses

if TYPE_CHECKING:
    from kvjax.radix.node import TreeNode

__all__ = ["OPTIMUM", "BeladyPolicy"]

OPTIMUM = "belady"
"""The name the replay and its reports give the offline optimum."""


class BeladyPolicy(EvictionPolicy):
    """Farthest next use first (module docstring).

    Args:
        uses: next-use times from the trace being replayed, built for the tree's page size.
        page_size: the tree's page size (tokens); a node's first page is its first
            ``page_size`` tokens.

    Attributes:
        now: index of the request being served (the replay sets it).
    """

    name = OPTIMUM
    monotone = False

    def __init__(self, uses: FutureUses, page_size: int) -> None:
        self.uses = uses
        self.page_size = page_size
        self.now = -1

    def first_page_token(self, node: TreeNode) -> int:
        """The last token of ``node``'s first page (which names the page and its prefix)."""
        return node.token_at(self.page_size - 1)

    def priority(self, node: TreeNode) -> tuple[int, int]:
        return (-self.uses.next_use(self.first_page_token(node), self.now), node.last_access)

    def __repr__(self) -> str:
        return f"BeladyPolicy(page_size={self.page_size})"
