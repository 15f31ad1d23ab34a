"""Reading traces: the Mooncake format, the token-id format, and bad input named by file and line."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvjax.errors import ConfigError
from kvjax.replay import Trace, TraceRequest, flatten_blocks, read_trace
from tests.replay._traces import EXCERPT, excerpt, token_trace


def write(tmp_path, records, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def mooncake(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_mooncake_blocks_expand_to_prefix_unique_tokens_trimmed_to_input_length(tmp_path):
    trace = read_trace(write(tmp_path, [mooncake(0, 600, 3, [0, 1]), mooncake(5, 512, 2, [0])]))
    assert trace.block_size == 512 and len(trace) == 2
    first = trace.prompt_tokens(0)
    assert first.dtype == np.int32 and first.shape == (600,)
    assert first[:512].tolist() == list(range(512)) and first[512:].tolist() == list(range(512, 600))
    assert trace.prompt_tokens(1).tolist() == list(range(512))
    # Outputs: fresh ids above every prompt token, unique per request.
    assert trace.output_base == 2 * 512
    assert trace.output_tokens(0).tolist() == [1024, 1025, 1026] and trace.output_tokens(1).tolist() == [1027, 1028]


def test_mooncake_requests_are_replayed_in_timestamp_order(tmp_path):
    trace = read_trace(write(tmp_path, [mooncake(9, 10, 1, [5]), mooncake(3, 10, 1, [6]), mooncake(9, 10, 1, [7])]))
    assert [int(r.blocks[0]) for r in trace.requests] == [6, 5, 7]  # file order among equal timestamps


def test_the_excerpt_reads_and_limit_cuts_it():
    trace = excerpt()
    assert len(trace) == 300 and trace.distinct_blocks() == 7814
    assert len(read_trace(EXCERPT, limit=10)) == 10


def test_token_format_relabels_prompts_into_shared_prefix_ids(tmp_path):
    trace = token_trace(tmp_path, [([7, 8, 9], 1), ([7, 8, 5], 0), ([9, 8], 2)])
    a, b, c = (trace.prompt_tokens(i).tolist() for i in range(3))
    assert a[:2] == b[:2] and a[2] != b[2]  # shared prefix [7, 8], then they differ
    assert c[0] not in a and c[1] != a[1]  # token 8 after 9 is another prefix than 8 after 7
    assert trace.block_size == 1 and trace.output_base > max(a + b + c)


BAD_MOONCAKE = [
    ("not json", "line 1: not JSON"),
    ("[1, 2]", "line 1: a JSON list, not an object"),
    (json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": [1]}), "line 1: 'input_length' is missing"),
    (json.dumps(mooncake(0, 513, 1, [1])), "line 1: 1 hash_ids (blocks of 512 tokens) cannot hold input_length 513"),
    (json.dumps(mooncake(0, 10, -1, [1])), "line 1: 'output_length' is -1"),
    (json.dumps(mooncake(-1, 10, 1, [1])), "line 1: 'timestamp' is -1"),
    (json.dumps(mooncake(0, 10, 1, [])), "line 1: 'hash_ids' must be a non-empty list"),
]


@pytest.mark.parametrize("line, words", BAD_MOONCAKE)
def test_bad_mooncake_lines_name_the_file_and_line(tmp_path, line, words):
    path = write(tmp_path, [line])
    with pytest.raises(ConfigError, match=re.escape(words)) as info:
        read_trace(path)
    assert info.value.value == str(path)


def test_a_block_at_two_positions_is_refused(tmp_path):
    path = write(tmp_path, [mooncake(0, 1024, 1, [0, 1]), mooncake(1, 1024, 1, [1, 2])])
    with pytest.raises(ConfigError, match="request 1: block 1 at position 0, but at 1"):
        read_trace(path)


@pytest.mark.parametrize(
    "record, words",
    [
        ({"input_ids": [], "output_length": 1}, "line 2: 'input_ids' must be a non-empty list"),
        ({"input_ids": [1, "a"], "output_length": 1}, "line 2: 'input_ids' must be a non-empty list of integers"),
        ({"input_ids": [1]}, "line 2: 'output_length' is missing"),
    ],
)
def test_bad_token_lines_name_the_file_and_line(tmp_path, record, words):
    path = write(tmp_path, [{"input_ids": [1, 2], "output_length": 0}, record])
    with pytest.raises(ConfigError, match=words):
        read_trace(path, "tokens")


def test_unknown_format_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="use one of mooncake, tokens"):
        read_trace(write(tmp_path, []), "csv")


def test_flatten_gives_one_request_per_full_block_access():
    trace = Trace(
        [TraceRequest(0, np.array([0, 1]), 600, 5), TraceRequest(1, np.array([0, 2, 3]), 1536, 0)], block_size=512
    )
    flat = flatten_blocks(trace)
    assert [int(r.blocks[0]) for r in flat.requests] == [0, 0, 2, 3]  # block 1 is partial: left out
    assert all(r.input_length == 513 and r.output_length == 0 for r in flat.requests)
    assert len({int(r.blocks[1]) for r in flat.requests}) == 4  # a fresh last token each
