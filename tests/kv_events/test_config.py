"""``--kv-events-config``: SGLang's JSON fields and defaults; a bad value is one error naming the
field, the value and what to give."""

from __future__ import annotations

import json

import pytest

from kvjax.errors import ConfigError
from kvjax.kv_events.config import KVEventsConfig


def test_sglang_json_and_defaults():
    text = json.dumps(
        {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}
    )
    c = KVEventsConfig.from_json(text)
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.topic) == ("zmq", "tcp://*:5557", "tcp://*:5558", "kv-events")
    assert (c.buffer_steps, c.hwm, c.max_queue_size) == (10_000, 100_000, 100_000)  # SGLang's and vLLM's
    assert c.publishes and c.block_hash == "kvjax"
    assert not KVEventsConfig.from_json("{}").publishes, "publisher null by default"
    assert not KVEventsConfig(publisher="zmq", enable_kv_cache_events=False).publishes  # vLLM's switch
    assert KVEventsConfig().with_seed("7").hash_seed == "7"
    assert KVEventsConfig(hash_seed="1").with_seed("7").hash_seed == "1", "the JSON's seed wins"


@pytest.mark.parametrize(
    ("text", "field", "hint"),
    [
        ("{not json", "kv_events_config", "JSON object"),
        ("[1, 2]", "kv_events_config", "JSON object"),
        ('{"publisher": "kafka"}', "publisher", "'null', 'zmq'"),
        ('{"endpont": "tcp://*:1"}', "endpont", "endpoint"),
        ('{"endpoint": "http://x:1"}', "endpoint", "tcp://"),
        ('{"endpoint": "tcp://*"}', "endpoint", "port"),
        ('{"replay_endpoint": "tcp://*:5557"}', "replay_endpoint", "own address"),
        ('{"buffer_steps": 0}', "buffer_steps", ">= 1"),
        ('{"hwm": -1}', "hwm", ">= 0"),
        ('{"max_queue_size": "big"}', "max_queue_size", ">= 1"),
        ('{"buffer_steps": true}', "buffer_steps", ">= 1"),
        ('{"topic": 3}', "topic", "string"),
        ('{"block_hash": "md5"}', "block_hash", "sha256_cbor"),
        ('{"hash_seed": 0}', "hash_seed", "string"),
    ],
)
def test_a_bad_field_is_named(text, field, hint):
    with pytest.raises(ConfigError) as e:
        KVEventsConfig.from_json(text)
    assert e.value.option == field
    assert hint in str(e.value)


def test_sha256_cbor_without_a_seed_is_refused_when_attached():
    from kvjax.kv_events.block_hash import make_block_hasher

    with pytest.raises(ConfigError, match="hash_seed.*PYTHONHASHSEED"):
        make_block_hasher("sha256_cbor", None)
