"""`Trace`: a request trace in the form every replay reads, whatever file it came from.

A trace is a list of requests in arrival order. Each request's prompt is a run of *blocks*:
``block_size`` tokens each, the last one possibly partial. Block ids are **prefix-unique**: one
id always stands for the same block at the same position after the same prefix, so two prompts
that share a block id share everything before it (the Mooncake trace's ``hash_ids`` are such
ids; the token-id reader makes such ids from raw token ids). Token ids follow from the blocks:
token ``k`` of block ``b`` is ``b * block_size + k``, so a token id is prefix-unique too (it
determines every token before it), and comparing two prompts token by token gives the same
answer as comparing the original text would.

A request's outputs are fresh tokens, unique to it and never part of any later prompt: ids from
``output_base`` up, request by request (:meth:`Trace.output_tokens`).

Invariants (checked at construction; a violation is a `kvjax.ConfigError`):

* ``(len(blocks) - 1) * block_size < input_length <= len(blocks) * block_size``;
* a block id sits at one position in every prompt that holds it;
* every token id (outputs included) fits int32, the radix tree's key type.

Units: lengths and positions in tokens, ``timestamp_ms`` in milliseconds from the trace start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvjax.errors import ConfigError

__all__ = ["INT32_MAX", "Trace", "TraceRequest", "flatten_blocks"]

INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time, ms from the trace's start (>= 0).
        blocks: prefix-unique block ids of the prompt (int64, 1-D, non-empty).
        input_length: prompt tokens (>= 1).
        output_length: tokens generated (>= 0).
    """

    timestamp_ms: float
    blocks: np.ndarray
    input_length: int
    output_length: int


class Trace:
    """Requests in arrival order over prefix-unique blocks (module docstring).

    Args:
        requests: the requests, in the order they are replayed.
        block_size: tokens per block (>= 1): 512 for the Mooncake trace, 1 for token-id traces.
        source: where the trace came from (a path), for messages and reports.

    Raises:
        ConfigError: a request breaks an invariant of the module docstring (named by its index).
    """

    def __init__(self, requests: Sequence[TraceRequest], block_size: int, source: str = "<memory>") -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError("block_size", block_size, "use a whole number of tokens per block, >= 1")
        self.requests: tuple[TraceRequest, ...] = tuple(requests)
        self.block_size = block_size
        self.source = source
        self.block_position: dict[int, int] = {}
        """Position (block index in the prompt) of every block id."""
        positions = self.block_position
        for index, req in enumerate(self.requests):
            self._check_lengths(index, req)
            for pos, block in enumerate(req.blocks.tolist()):
                if positions.setdefault(block, pos) != pos:
                    raise ConfigError(
                        "trace",
                        source,
                        f"request {index}: block {block} at position {pos}, but at {positions[block]} in an earlier "
                        "request; a block id must stand for its whole prefix (one position)",
                    )
        max_block = max(positions) if positions else -1
        self.output_base = (max_block + 1) * block_size
        """The first output token id: above every prompt token id."""
        lengths = np.array([r.output_length for r in self.requests], dtype=np.int64)
        self._output_start = self.output_base + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        last = self.output_base + int(lengths.sum()) - 1
        if max(last, self.output_base - 1) > INT32_MAX:
            raise ConfigError(
                "trace",
                source,
                f"its token ids reach {max(last, self.output_base - 1)}, above int32 (the tree's key type): "
                "replay fewer requests (--limit) or a trace with fewer distinct blocks",
            )

    def _check_lengths(self, index: int, req: TraceRequest) -> None:
        n = int(req.blocks.shape[0])
        b = self.block_size
        if req.blocks.ndim != 1 or n == 0 or not (n - 1) * b < req.input_length <= n * b:
            raise ConfigError(
                "trace",
                self.source,
                f"request {index}: {n} blocks of {b} tokens cannot hold input_length {req.input_length} "
                f"(it must be in ({(n - 1) * b}, {n * b}])",
            )
        if req.output_length < 0 or req.timestamp_ms < 0:
            raise ConfigError("trace", self.source, f"request {index}: lengths and timestamps must be >= 0")
        if req.blocks.size and int(req.blocks.min()) < 0:
            raise ConfigError("trace", self.source, f"request {index}: block ids must be >= 0")

    def __len__(self) -> int:
        return len(self.requests)

    def head(self, limit: int | None) -> Trace:
        """The first ``limit`` requests (all of them for None)."""
        if limit is None or limit >= len(self.requests):
            return self
        return Trace(self.requests[:limit], self.block_size, self.source)

    def prompt_tokens(self, index: int) -> np.ndarray:
        """Request ``index``'s prompt token ids (int32, ``input_length`` of them)."""
        req = self.requests[index]
        b = self.block_size
        if b == 1:
            return req.blocks.astype(np.int32)
        tokens = (req.blocks[:, None] * b + np.arange(b, dtype=np.int64)).reshape(-1)
        return tokens[: req.input_length].astype(np.int32)

    def output_tokens(self, index: int) -> np.ndarray:
        """Request ``index``'s output token ids (int32): fresh, unique to it."""
        start = int(self._output_start[index])
        return np.arange(start, start + self.requests[index].output_length, dtype=np.int32)

    def prompt_token_count(self) -> int:
        """Prompt tokens over all requests."""
        return sum(r.input_length for r in self.requests)

    def distinct_blocks(self) -> int:
        """Distinct block ids over all prompts."""
        return len(self.block_position)

    def distinct_prompt_tokens(self) -> int:
        """Distinct prompt token ids over all requests: what a cache holding every prompt needs
        (a block's tokens counted up to the longest prefix of it any request holds)."""
        longest: dict[int, int] = {}
        b = self.block_size
        for req in self.requests:
            last = int(req.blocks[-1])
            tail = req.input_length - (int(req.blocks.shape[0]) - 1) * b
            if longest.get(last, 0) < tail:
                longest[last] = tail
        full = self.distinct_blocks() - len(longest)
        return full * b + sum(longest.values())


def flatten_blocks(trace: Trace) -> Trace:
    """The trace with its prefix structure removed: each block access of each prompt becomes a
    request of its own, in order, whose prompt is that block alone (as a position-0 block) plus
    one fresh token, with no output. Replayed at ``page_size == block_size`` every block is a
    leaf under the root, so eviction is unconstrained by prefixes: the trace of single-object
    accesses a flat cache sees (each request can hit its one block and nothing else).

    Only full blocks are kept (a partial last block is its own object, but its tokens are not a
    whole page); ids stay prefix-unique: original block ``b`` keeps id ``b`` and the fresh
    token of access ``i`` gets block id ``max_block + 1 + i``.
    """
    b = trace.block_size
    fresh = max(trace.block_position, default=-1) + 1
    out: list[TraceRequest] = []
    for req in trace.requests:
        full = req.input_length // b
        for block in req.blocks[:full].tolist():
            out.append(TraceRequest(req.timestamp_ms, np.array([block, fresh], dtype=np.int64), b + 1, 0))
            fresh += 1
    return Trace(out, b, f"{trace.source} (flattened)")
