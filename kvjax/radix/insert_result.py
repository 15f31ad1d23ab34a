"""`InsertResult`: what ``RadixCache.insert_with`` returns (SGLang 0.5.23's ``InsertResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class InsertResult:
    """The outcome of one insert.

    Attributes:
        prefix_len: key elements that were already cached (host-only nodes the insert made
            device-resident again count as cached: the tree took the incoming slots there).
        last_node: the node covering the last inserted key element (the root for an empty key).
        results: per-component insert results, by component name (``commit_insert``'s return
            values; e.g. a donated state slot the caller must free because the end node already
            had one). Empty for a FULL-only tree.
    """

    prefix_len: int
    last_node: Any
    results: dict[str, Any] = field(default_factory=dict)
