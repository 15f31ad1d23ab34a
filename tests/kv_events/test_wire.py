"""The wire: three frames (topic, 8-byte big-endian sequence number, msgpack payload), the batch
and its events array-like in vLLM's field order, decodable by vLLM's layouts old and new; the
publisher's replay answers, its bounded queue and a clean close; imports stay lazy."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from kvjax.errors import ConfigError  # noqa: E402
from kvjax.kv_events.bridge import EventBridge  # noqa: E402
from kvjax.kv_events.publisher import ZmqEventPublisher, offset_endpoint  # noqa: E402
from kvjax.kv_events.subscriber import EventSubscriber  # noqa: E402
from kvjax.kv_events.wire import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from kvjax.page_hash import PageHasher  # noqa: E402
from kvjax.radix import events as tree_events  # noqa: E402
from tests.kv_events import vllm_layout as vllm  # noqa: E402


def _stored(medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=[11, -12],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def test_the_payload_is_vllms_array_layout():
    batch = KVEventBatch(
        ts=1.5, events=[_stored(), BlockRemoved(block_hashes=[11], medium="CPU_TIER1")], data_parallel_rank=1
    )
    raw = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(raw) == [
        1.5,
        [
            ["BlockStored", [11, -12], None, [1, 2, 3, 4], 2, None, "GPU", None, None, None],
            ["BlockRemoved", [11], "CPU_TIER1", None],
        ],
        1,
    ]
    new = msgspec.msgpack.Decoder(type=vllm.KVEventBatch).decode(raw)
    assert new.data_parallel_rank == 1 and new.events[0].medium == "GPU" and new.events[0].extra_keys is None
    old = msgspec.msgpack.Decoder(type=vllm.OldKVEventBatch).decode(raw)  # six fields, no DP rank
    assert old.events[0].block_hashes == [11, -12] and old.events[1].medium == "CPU_TIER1"


def test_the_bridge_maps_media_trims_bigram_tokens_and_carries_the_salt():
    sent: list = []

    class Collect:
        def publish(self, batch):
            sent.append(batch)

        def close(self):
            pass

    bridge = EventBridge(Collect(), PageHasher(0), data_parallel_rank=3, clock=lambda: 2.0)
    assert bridge.flush() == 0 and not sent, "an idle step publishes nothing"
    bridge(tree_events.BlockStored([5, 6], None, [1, 2, 3, 4, 5], 2, extra_key="tenant", medium="host"))
    bridge(tree_events.BlockRemoved([5], medium="device"))
    bridge(tree_events.AllBlocksCleared())
    assert bridge.flush() == 3
    (batch,) = sent
    stored, removed, cleared = batch.events
    assert (batch.ts, batch.data_parallel_rank) == (2.0, 3)
    assert stored.token_ids == [1, 2, 3, 4] and stored.medium == "CPU_TIER1"
    assert stored.extra_keys == [("tenant",), None]
    assert removed.medium == "GPU" and type(cleared).__name__ == "AllBlocksCleared"


def test_three_frames_sequence_numbers_and_replay(tmp_path):
    pub_addr, replay_addr = f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r"
    with ZmqEventPublisher(pub_addr, replay_addr, topic="kv", buffer_steps=3) as pub:
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)  # a failed check never leaves a context that blocks when collected
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub_addr)
        time.sleep(0.3)
        for i in range(5):
            pub.publish(KVEventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[i], medium="GPU")]))
        frames = [sub.recv_multipart() for _ in range(5)] if sub.poll(2000) else []
        assert [f[0] for f in frames] == [b"kv"] * 5
        assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [0, 1, 2, 3, 4]
        assert all(len(f[1]) == 8 for f in frames)
        sub.close(linger=0)
        ctx.term()
        client = EventSubscriber(pub_addr, replay_addr, topic="kv")
        got = client.replay(0)
        assert [s for s, _ in got] == [2, 3, 4], "the buffer keeps the last buffer_steps batches"
        assert client.lost_batches == 2
        assert [b.events[0].block_hashes for _, b in got] == [[2], [3], [4]]
        assert got[0][1].data_parallel_rank == 0, "a single server is rank 0"
        client.close()
    assert pub.published_batches == 5 and pub.replays_served == 1
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(KVEventBatch(ts=0.0, events=[]))
    pub.close()  # idempotent


def test_a_full_queue_drops_instead_of_blocking_and_close_is_bounded(tmp_path):
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/q", max_queue_size=1)
    gate = threading.Event()
    real = pub._pub.send_multipart
    pub._pub.send_multipart = lambda *a, **k: (gate.wait(1.0), real(*a, **k))  # a slow network
    start = time.monotonic()
    for i in range(6):
        pub.publish(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[i], medium="GPU")]))
    assert time.monotonic() - start < 2.0 and pub.dropped_batches > 0
    gate.set()
    start = time.monotonic()
    pub.close()
    assert time.monotonic() - start < pub.CLOSE_TIMEOUT + 1.0
    assert not pub._thread.is_alive()


def test_bad_addresses_name_the_field_and_leave_nothing_open(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with ZmqEventPublisher(taken.replace("127.0.0.1", "*")), pytest.raises(ConfigError, match="endpoint"):
        ZmqEventPublisher(taken.replace("127.0.0.1", "*"))
    with pytest.raises(ConfigError, match="replay_endpoint"):
        ZmqEventPublisher(f"ipc://{tmp_path}/a", "tcp://*:notaport")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("inproc://ev", 1) == "inproc://ev_dp1"
    assert offset_endpoint("ipc:///tmp/ev", 0) == "ipc:///tmp/ev"


def test_importing_the_package_loads_neither_msgspec_nor_zmq():
    code = (
        "import sys, kvjax.kv_events, kvjax.kv_events.config\n"
        'kvjax.kv_events.KVEventsConfig.from_json(\'{"publisher": "zmq"}\')\n'
        "assert 'msgspec' not in sys.modules and 'zmq' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
