"""`read_trace`: a trace file of one of the formats a replay reads, by the format's name.

* ``mooncake``: the Mooncake FAST'25 format (``mooncake.py``): ``timestamp``, ``input_length``,
  ``output_length``, ``hash_ids`` (512-token blocks).
* ``tokens``: one request per line with its token ids (``token_trace.py``): ``timestamp``,
  ``input_ids``, ``output_length``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvjax.errors import ConfigError
from kvjax.replay.mooncake import read_mooncake_trace
from kvjax.replay.token_trace import read_token_trace
from kvjax.replay.trace import Trace

__all__ = ["TRACE_FORMATS", "read_trace"]

TRACE_FORMATS: dict[str, Callable[[str | Path, int | None], Trace]] = {
    "mooncake": read_mooncake_trace,
    "tokens": read_token_trace,
}


def read_trace(path: str | Path, trace_format: str = "mooncake", limit: int | None = None) -> Trace:
    """The trace at ``path`` in ``trace_format`` (first ``limit`` requests when given).

    Raises:
        ConfigError: an unknown format, or bad content (named by file and line).
        FileNotFoundError: no such file.
    """
    reader = TRACE_FORMATS.get(trace_format)
    if reader is None:
        raise ConfigError("trace_format", trace_format, f"use one of {', '.join(TRACE_FORMATS)}")
    return reader(path, limit)
