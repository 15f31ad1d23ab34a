"""Lock receipts: what a lock took, so that releasing it replays exactly that."""

from __future__ import annotations

from typing import Any


class LockError(RuntimeError):
    """An unlock that does not match a lock: below zero, released twice, or on a node that no
    longer belongs to the tree. The tree is unchanged when this is raised."""


class LockReceipt:
    """Returned by ``inc_lock_ref``; hand it (or the node) back to ``dec_lock_ref``.

    Attributes:
        node: the locked node (every ancestor up to the root is locked too); None for a no-op
            lock (root, chunk cache, disabled tree).
        delta: change in evictable tokens caused by the lock (<= 0), as SGLang returns.
        parts: per extra component, what that component locked (replayed on release).
        released: True once handed back; a second release raises :class:`LockError`.
        touch: ``(time, prompt time, prompt length)`` of the holder's last checkpoint
            (``cache_unfinished_req``), or None: what SGLang 0.5.23's walk from the root gave
            the locked path then, replayed if the holder is released without an insert.
    """

    __slots__ = ("node", "delta", "parts", "released", "owner", "touch")

    def __init__(self, node: Any, delta: int, parts: tuple | None = None, owner: object = None) -> None:
        self.node = node
        self.delta = delta
        self.parts = parts
        self.released = False
        self.owner = owner
        self.touch: tuple[int, int, int] | None = None

    def __repr__(self) -> str:
        nid = None if self.node is None else getattr(self.node, "id", None)
        return f"LockReceipt(node={nid}, delta={self.delta}, released={self.released})"
