"""`EventRouter`: a fleet router that knows the servers' caches only from their KV event streams
(as llm-d's kv-cache-manager and Dynamo's KV router do), and routes each request to the server
(or DP rank) holding its longest prefix (jax-free, no dependency).

Per stream (a server, or a DP rank's stream) it keeps the set of block hashes the stream reports
cached in the media it counts (default: the device's, ``"GPU"``): ``BlockStored`` adds,
``BlockRemoved`` removes, ``AllBlocksCleared`` empties. ``route(tokens)`` hashes the request's
whole pages with the servers' hasher (``Sha256CborHasher.hash_tokens``: from the token ids alone)
and picks the stream whose set holds the longest run of them from the first; ties (and misses)
go to the stream that was given the fewest requests, then the lowest rank.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

__all__ = ["EventRouter"]


class EventRouter:
    """Longest-prefix routing over ``num_streams`` event streams (module docstring).

    Args:
        num_streams: the servers or DP ranks.
        hash_tokens: ``(tokens, cache_salt) -> block hashes`` as the events carry them.
        media: the media whose blocks count as cached.
    """

    def __init__(
        self,
        num_streams: int,
        hash_tokens: Callable[[Sequence[int], Hashable], list[Any]],
        *,
        media: Iterable[str | None] = ("GPU",),
    ) -> None:
        if num_streams < 1:
            raise ValueError(f"EventRouter: num_streams={num_streams}; give 1 or more")
        self.blocks: list[set[Any]] = [set() for _ in range(num_streams)]
        self.routed = [0] * num_streams
        self.hash_tokens = hash_tokens
        self.media = frozenset(media)

    def apply(self, stream: int, batch: Any) -> None:
        """Apply one decoded batch of ``stream`` (any struct with vLLM's ``events``: tagged
        ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` by class name)."""
        blocks = self.blocks[stream]
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                if event.medium in self.media:
                    blocks.update(event.block_hashes)
            elif kind == "BlockRemoved":
                if event.medium in self.media:
                    blocks.difference_update(event.block_hashes)
            elif kind == "AllBlocksCleared":
                blocks.clear()

    def prefix_blocks(self, hashes: Sequence[Any]) -> list[int]:
        """Per stream, how many of ``hashes`` (a request's, in order) it holds from the first."""
        out = []
        for blocks in self.blocks:
            n = 0
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
            out.append(n)
        return out

    def route(self, tokens: Sequence[int], cache_salt: Hashable = None) -> int:
        """The stream to send a request of ``tokens`` to (module docstring); counts it there."""
        hits = self.prefix_blocks(self.hash_tokens(tokens, cache_salt))
        best = max(range(len(hits)), key=lambda r: (hits[r], -self.routed[r], -r))
        self.routed[best] += 1
        return best
