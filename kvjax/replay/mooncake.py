"""Reading the Mooncake trace format (FAST'25 release: ``conversation_trace.jsonl`` and its kin).

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp``: arrival in ms from the trace's start; ``input_length`` / ``output_length``: prompt
and generated tokens; ``hash_ids``: one id per 512-token block of the prompt, the last block
possibly partial, and an id stands for its whole prefix (two prompts sharing a block id share
every token before it). Blank lines are skipped. Requests are replayed in timestamp order (the
file's order among equal timestamps).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.replay.trace import Trace, TraceRequest

__all__ = ["MOONCAKE_BLOCK_TOKENS", "read_mooncake_trace", "parse_json_line", "whole_number"]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces."""


def parse_json_line(path: str, lineno: int, line: str) -> dict[str, Any]:
    """One JSON object from ``line`` (line ``lineno`` of ``path``), or a `ConfigError` naming both."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError("trace", path, f"line {lineno}: not JSON ({e.msg}); each line is one JSON object") from None
    if not isinstance(record, dict):
        raise ConfigError("trace", path, f"line {lineno}: a JSON {type(record).__name__}, not an object")
    return record


def json_records(path: str | Path, limit: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, JSON object)`` for each non-blank line of ``path``, the first ``limit`` only
    when given; a `ConfigError` naming the file and line for one that is not a JSON object."""
    name, count = str(path), 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            if line.strip():
                count += 1
                yield lineno, parse_json_line(name, lineno, line)


def arrival_ms(record: dict[str, Any], path: str, lineno: int, default: float | None = None) -> float:
    """``record["timestamp"]`` in ms (``default`` when absent and given), or a `ConfigError`."""
    timestamp = record.get("timestamp", default)
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or timestamp < 0:
        raise ConfigError("trace", path, f"line {lineno}: 'timestamp' is {timestamp!r}; use ms >= 0")
    return float(timestamp)


def whole_number(record: dict[str, Any], key: str, path: str, lineno: int, *, minimum: int = 0) -> int:
    """``record[key]`` as an int >= ``minimum``, or a `ConfigError` naming the file, line and key."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        got = "missing" if key not in record else repr(value)
        raise ConfigError("trace", path, f"line {lineno}: {key!r} is {got}; it must be a whole number >= {minimum}")
    return value


def read_mooncake_trace(path: str | Path, limit: int | None = None) -> Trace:
    """The Mooncake trace at ``path`` as a `Trace` (block size 512), its first ``limit`` lines
    (non-blank) only when given.

    Raises:
        FileNotFoundError: no such file.
        ConfigError: a line that is not a JSON object with the four fields (whole numbers >= 0,
            ``hash_ids`` a non-empty list of them), or whose ``hash_ids`` cannot hold
            ``input_length`` tokens; the message names the file and the line.
    """
    name = str(path)
    requests: list[tuple[float, int, TraceRequest]] = []
    for lineno, record in json_records(path, limit):
        timestamp = arrival_ms(record, name, lineno)
        input_length = whole_number(record, "input_length", name, lineno, minimum=1)
        output_length = whole_number(record, "output_length", name, lineno)
        ids = record.get("hash_ids")
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            raise ConfigError("trace", name, f"line {lineno}: 'hash_ids' must be a non-empty list of ids >= 0")
        n = len(ids)
        if not (n - 1) * MOONCAKE_BLOCK_TOKENS < input_length <= n * MOONCAKE_BLOCK_TOKENS:
            raise ConfigError(
                "trace",
                name,
                f"line {lineno}: {n} hash_ids (blocks of {MOONCAKE_BLOCK_TOKENS} tokens) cannot hold "
                f"input_length {input_length}",
            )
        req = TraceRequest(float(timestamp), np.array(ids, dtype=np.int64), input_length, output_length)
        requests.append((timestamp, lineno, req))
    requests.sort(key=lambda item: (item[0], item[1]))
    return Trace([r for _, _, r in requests], MOONCAKE_BLOCK_TOKENS, name)
