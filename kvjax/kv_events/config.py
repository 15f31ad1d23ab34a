"""`KVEventsConfig`: where and how a server publishes its KV events, parsed from SGLang's
``--kv-events-config`` JSON (jax-free, no dependency beyond the standard library).

The fields and their defaults are SGLang's (``sglang.srt.disaggregation.kv_events.KVEventsConfig``)
and vLLM's (``vllm.config.kv_events.KVEventsConfig``)::

    {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
     "topic": "kv-events", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000}

vLLM's ``enable_kv_cache_events`` is accepted too (False publishes nothing, as vLLM does). kvjax
adds two fields of its own: ``block_hash``, the page hash the events carry (``"kvjax"``, the
default, the tree's chained SHA-256 truncated to int64, the one the storage tier keys pages by;
or ``"sha256_cbor"``, vLLM's, which a router recomputes from token ids), and ``hash_seed``, the
seed of ``sha256_cbor`` (vLLM's ``PYTHONHASHSEED``; the command line fills it from that variable
when the JSON has none).

A bad value raises one `ConfigError` naming the field, the value and what to give instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from kvjax.errors import ConfigError

__all__ = ["BLOCK_HASHES", "PUBLISHERS", "KVEventsConfig"]

#: Publisher names (SGLang's and vLLM's): ``"zmq"`` publishes, ``"null"`` publishes nothing.
PUBLISHERS = ("null", "zmq")
#: Page hashes the events may carry (``kvjax.kv_events.block_hash``).
BLOCK_HASHES = ("kvjax", "sha256_cbor")
#: Endpoint schemes ZMQ serves here.
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """Where a server publishes its KV events (module docstring).

    Attributes:
        publisher: ``"zmq"`` or ``"null"`` (nothing published).
        endpoint: the PUB socket's address; an address with ``*`` or ``::``, or an ``ipc://`` or
            ``inproc://`` one, is bound, any other is connected to (vLLM's rule). DP rank ``r``
            publishes at the port plus ``r`` (tcp) or the address plus ``_dp{r}``.
        replay_endpoint: the ROUTER socket that replays buffered batches (None: no replay).
        buffer_steps: batches kept for replay (one batch per scheduler step), >= 1.
        hwm: the PUB socket's high-water mark in messages (0: unbounded), >= 0.
        max_queue_size: batches waiting for the publisher thread, >= 1.
        topic: the first frame of every message (subscribers filter by its prefix).
        enable_kv_cache_events: vLLM's switch (False: publish nothing).
        block_hash: ``"kvjax"`` or ``"sha256_cbor"`` (module docstring).
        hash_seed: the ``sha256_cbor`` seed string (vLLM's ``PYTHONHASHSEED``); None with
            ``"kvjax"``.
    """

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    enable_kv_cache_events: bool = True
    block_hash: str = "kvjax"
    hash_seed: str | None = None

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ConfigError("publisher", self.publisher, f"use one of {', '.join(map(repr, PUBLISHERS))}")
        _endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint:
                raise ConfigError("replay_endpoint", self.replay_endpoint, "give the replay socket its own address")
        _count("buffer_steps", self.buffer_steps, 1)
        _count("hwm", self.hwm, 0)
        _count("max_queue_size", self.max_queue_size, 1)
        _typed("topic", self.topic, str, "a string")
        _typed("enable_kv_cache_events", self.enable_kv_cache_events, bool, "true or false")
        if self.block_hash not in BLOCK_HASHES:
            raise ConfigError("block_hash", self.block_hash, f"use one of {', '.join(map(repr, BLOCK_HASHES))}")
        if self.hash_seed is not None:
            _typed("hash_seed", self.hash_seed, str, 'a string (vLLM\'s PYTHONHASHSEED, e.g. "0")')

    @property
    def publishes(self) -> bool:
        """Whether this configuration publishes anything (a ZMQ publisher, events enabled)."""
        return self.publisher == "zmq" and self.enable_kv_cache_events

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config`` (a JSON object of the fields above).

        Raises ConfigError naming the offending field (or ``kv_events_config`` for text that is
        not a JSON object)."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise ConfigError(
                "kv_events_config", text, f'give a JSON object such as \'{{"publisher": "zmq"}}\' ({e})'
            ) from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVEventsConfig:
        """The configuration of a mapping of the fields above; ConfigError naming an unknown
        field (with the known ones) or a bad value."""
        if not isinstance(data, Mapping):
            raise ConfigError("kv_events_config", data, 'give a JSON object such as \'{"publisher": "zmq"}\'')
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                raise ConfigError(key, data[key], f"not a KV events field; use {', '.join(known)}")
        return cls(**dict(data))

    def with_seed(self, seed: str | None) -> KVEventsConfig:
        """This configuration with ``hash_seed`` set to ``seed`` where it has none (the command
        line passes ``PYTHONHASHSEED``)."""
        if self.hash_seed is not None or seed is None:
            return self
        return dataclasses.replace(self, hash_seed=seed)


def _endpoint(name: str, value: object) -> None:
    if not isinstance(value, str) or not value.startswith(_SCHEMES) or value in _SCHEMES:
        raise ConfigError(name, value, f"give a ZMQ address starting with {', '.join(_SCHEMES)} (e.g. tcp://*:5557)")
    if value.startswith("tcp://"):
        port = value.rpartition(":")[2]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(name, value, "give a tcp address with a port, e.g. tcp://*:5557")


def _count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(name, value, f"use an integer >= {least}")


def _typed(name: str, value: object, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise ConfigError(name, value, f"use {what}")
