"""`RecencyList`: a component's own recency order of tree nodes, oldest first.

SGLang 0.5.23 keeps each auxiliary component's recency (the SWA window's) in a doubly linked list
so that a split can put the new upper half right beside the suffix (``insert_after``) instead of
at the most recent end. An ``OrderedDict`` cannot insert in the middle; this list can, and keeps
every other operation O(1) too.

Invariant: the links form one chain from the oldest to the newest member; ``_links`` holds
exactly the members, each mapped to its ``[older, newer]`` neighbours (``None`` at the ends).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

__all__ = ["RecencyList"]

_OLDER = 0
_NEWER = 1


class RecencyList:
    """Hashable items (tree nodes) ordered from the least to the most recent.

    ``append`` / ``move_to_end`` make an item the most recent, ``insert_before`` places a new
    item just older than a member, ``remove`` drops one; all O(1). Iteration runs oldest first;
    take a ``list(...)`` of it before removing items while walking.
    """

    __slots__ = ("_links", "_oldest", "_newest")

    def __init__(self) -> None:
        self._links: dict[Any, list[Any]] = {}
        self._oldest: Any = None
        self._newest: Any = None

    def __len__(self) -> int:
        return len(self._links)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._links

    def __iter__(self) -> Iterator[Any]:
        links = self._links
        item = self._oldest
        while item is not None:
            yield item
            item = links[item][_NEWER]

    def clear(self) -> None:
        """Drop every item."""
        self._links.clear()
        self._oldest = self._newest = None

    def append(self, item: Hashable) -> None:
        """Add ``item`` (not a member) as the most recent. Raises KeyError for a member."""
        if item in self._links:
            raise KeyError(f"RecencyList.append: {item!r} is already a member")
        newest = self._newest
        self._links[item] = [newest, None]
        if newest is None:
            self._oldest = item
        else:
            self._links[newest][_NEWER] = item
        self._newest = item

    def insert_before(self, anchor: Hashable, item: Hashable) -> None:
        """Add ``item`` (not a member) just older than the member ``anchor`` (SGLang's
        ``insert_after`` in its newest-first list). Raises KeyError when ``anchor`` is not a
        member or ``item`` already is."""
        links = self._links
        if item in links:
            raise KeyError(f"RecencyList.insert_before: {item!r} is already a member")
        anchor_links = links[anchor]
        older = anchor_links[_OLDER]
        links[item] = [older, anchor]
        anchor_links[_OLDER] = item
        if older is None:
            self._oldest = item
        else:
            links[older][_NEWER] = item

    def remove(self, item: Hashable) -> None:
        """Drop the member ``item``. Raises KeyError when it is not a member."""
        older, newer = self._links.pop(item)
        if older is None:
            self._oldest = newer
        else:
            self._links[older][_NEWER] = newer
        if newer is None:
            self._newest = older
        else:
            self._links[newer][_OLDER] = older

    def move_to_end(self, item: Hashable) -> None:
        """Make the member ``item`` the most recent. Raises KeyError when it is not a member."""
        links = self._links
        link = links[item]
        newer = link[_NEWER]
        if newer is None:
            return  # already the most recent
        # Unlink (inlined: this is the hot call of a match's window refresh), then relink last.
        older = link[_OLDER]
        if older is None:
            self._oldest = newer
        else:
            links[older][_NEWER] = newer
        links[newer][_OLDER] = older
        newest = self._newest
        links[newest][_NEWER] = item
        link[_OLDER] = newest
        link[_NEWER] = None
        self._newest = item
