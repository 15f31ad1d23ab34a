"""Reading a trace of token ids: the simple format for traces recorded from a server.

One JSON object per line::

    {"timestamp": 12.5, "input_ids": [1, 15043, 29892, ...], "output_length": 64}

``timestamp``: arrival in ms (>= 0; optional, default: the line's order); ``input_ids``: the
prompt's token ids (a non-empty list of integers; any vocabulary); ``output_length``: tokens
generated (>= 0). Blank lines are skipped; requests are replayed in timestamp order (file
order among equal timestamps).

The prompts are re-labelled into prefix-unique ids (``trace.py``) with a trie: each distinct
prefix gets one id, so two prompts share their first ``n`` ids exactly when they share their
first ``n`` tokens. The tree compares tokens only between keys that share everything before
them, so a replay over the ids behaves exactly as one over the raw tokens. Blocks are single
tokens (``block_size == 1``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvjax.errors import ConfigError
from kvjax.replay.mooncake import arrival_ms, json_records, whole_number
from kvjax.replay.trace import Trace, TraceRequest

__all__ = ["read_token_trace"]


def read_token_trace(path: str | Path, limit: int | None = None) -> Trace:
    """The token-id trace at ``path`` as a `Trace` (block size 1), its first ``limit`` requests
    only when given.

    Raises:
        FileNotFoundError: no such file.
        ConfigError: a line that is not a JSON object with ``input_ids`` (a non-empty list of
            integers) and ``output_length`` (a whole number >= 0), or with a negative or
            non-numeric ``timestamp``; the message names the file and the line.
    """
    name = str(path)
    prefix_ids: dict[tuple[int, int], int] = {}  # (parent prefix id, token) -> prefix id; root: -1
    requests: list[tuple[float, int, TraceRequest]] = []
    for lineno, record in json_records(path, limit):
        timestamp = arrival_ms(record, name, lineno, default=float(len(requests)))
        tokens = record.get("input_ids")
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        ):
            raise ConfigError("trace", name, f"line {lineno}: 'input_ids' must be a non-empty list of integers")
        output_length = whole_number(record, "output_length", name, lineno)
        ids = np.empty(len(tokens), dtype=np.int64)
        parent = -1
        for i, token in enumerate(tokens):
            parent = prefix_ids.setdefault((parent, token), len(prefix_ids))
            ids[i] = parent
        requests.append((float(timestamp), lineno, TraceRequest(float(timestamp), ids, len(tokens), output_length)))
    requests.sort(key=lambda item: (item[0], item[1]))
    return Trace([r for _, _, r in requests], 1, name)
