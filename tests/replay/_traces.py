"""Helpers for the replay tests: the trace excerpt shipped with the tests, and small traces."""

from __future__ import annotations

import json
from pathlib import Path

from kvjax.replay import Trace, read_trace

EXCERPT = Path(__file__).resolve().parent.parent / "data" / "traces" / "mooncake_first300.jsonl"
"""The first 300 requests of the Mooncake FAST'25 conversation trace (Apache-2.0)."""


def excerpt() -> Trace:
    return read_trace(EXCERPT, "mooncake")


def full_capacity(trace: Trace) -> int:
    """Tokens of the trace's distinct blocks: every prompt fits."""
    return trace.distinct_blocks() * trace.block_size


def token_trace(tmp_path: Path, requests: list[tuple[list[int], int]], name: str = "t.jsonl") -> Trace:
    """A token-id trace file of ``(input_ids, output_length)`` requests, one ms apart, read back."""
    path = tmp_path / name
    lines = [
        json.dumps({"timestamp": i, "input_ids": ids, "output_length": out}) for i, (ids, out) in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n")
    return read_trace(path, "tokens")
