"""A real ZMQ subscriber, decoding with vLLM's published layout (``vllm_layout.py``), rebuilds a
server's cached block set, per medium, exactly from the event stream alone: on the demo workload
with eviction and the host tier, at page sizes 1 and 16, for two DP ranks' per-rank streams, and
after the subscriber dropped and came back through the replay socket."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvjax.kv_events.blocks import cached_blocks  # noqa: E402
from kvjax.kv_events.config import KVEventsConfig  # noqa: E402
from kvjax.serve.kv_events import attach_kv_events  # noqa: E402
from kvjax.serve.workload import Workload, run_workload  # noqa: E402
from tests.kv_events.tree_server import TreeServer  # noqa: E402
from tests.kv_events.vllm_layout import Mirror  # noqa: E402

# The demo's workload (4 groups of 6 over 256-token system prompts, 4 chats of 3 turns), its
# cache too small to hold it: eviction from the device, demotion to and eviction from the host.
DEMO = Workload()


def _addresses(tmp_path, name: str) -> tuple[str, str]:
    return f"ipc://{tmp_path}/{name}-pub", f"ipc://{tmp_path}/{name}-replay"


def _config(pub: str, replay: str, **kw) -> KVEventsConfig:
    return KVEventsConfig(publisher="zmq", endpoint=pub, replay_endpoint=replay, topic="kv", **kw)


def _joined() -> None:
    """Let the subscribers' connections reach the publishers before anything is published."""
    time.sleep(0.3)


@pytest.mark.parametrize(
    ("page_size", "block_hash"), [(1, "kvjax"), (16, "sha256_cbor")], ids=["page1-kvjax", "page16-sha256_cbor"]
)
def test_subscriber_rebuilds_the_cached_blocks_with_eviction_and_the_host_tier(tmp_path, page_size, block_hash):
    server = TreeServer(page_size, capacity=1024, host_tokens=1536)
    pub, replay = _addresses(tmp_path, "one")
    mirror = Mirror(pub, replay, topic="kv")
    streams = attach_kv_events(server, _config(pub, replay, block_hash=block_hash, hash_seed="0"))
    _joined()
    try:
        run_workload(server, DEMO)
        streams.flush()
        mirror.drain()
        expected = cached_blocks(server.tree)
        assert mirror.blocks == expected
        media = {m for m, _ in expected}
        assert media == {"GPU", "CPU_TIER1"}, "device and host pages both cached at the end"
        tree = server.tree
        assert tree.stats.evicted_tokens > 0 and server.loaded_back > 0, "the workload evicts and loads back"
        assert mirror.ranks == {0}
        assert mirror.batches > mirror.replayed, "batches arrived live, not only through the replay"
    finally:
        streams.close()
        mirror.close()


def test_a_dropped_subscriber_catches_up_through_the_replay_socket(tmp_path):
    server = TreeServer(16, capacity=1024, host_tokens=1536)
    pub, replay = _addresses(tmp_path, "drop")
    first = Mirror(pub, replay, topic="kv")
    streams = attach_kv_events(server, _config(pub, replay))
    _joined()
    half = dataclasses.replace(DEMO, chats=0)
    try:
        run_workload(server, half)
        streams.flush()
        first.drain()
        assert first.blocks == cached_blocks(server.tree)
        first.sub.close(linger=0)  # the subscriber drops; the server goes on
        run_workload(server, dataclasses.replace(DEMO, groups=0, seed=1))
        streams.flush()
        # Everything sent before the subscriber comes back: what it missed is only in the replay
        # buffer (a batch still queued would reach the new subscription live instead).
        assert streams.wait_sent()
        back = Mirror(pub, replay, topic="kv")
        back.blocks, back.last_seq = first.blocks, first.last_seq  # what it knew when it dropped
        first.close()
        try:
            back.replay_from(back.last_seq + 1)
            back.drain()
            assert back.replayed > 0
            assert back.blocks == cached_blocks(server.tree)
        finally:
            back.close()
    finally:
        streams.close()


class _RoundRobinFront:
    """A DP front over per-rank servers: requests in turn to each rank, every rank stepped."""

    def __init__(self, schedulers) -> None:
        self.schedulers = schedulers
        self._next = 0
        self.finished: list = []

    @property
    def idle(self) -> bool:
        return all(s.idle for s in self.schedulers)

    def submit(self, reqs) -> None:
        for r in reqs:
            self.schedulers[self._next].submit([r])
            self._next = (self._next + 1) % len(self.schedulers)

    def step(self) -> list:
        done = [r for s in self.schedulers if not s.idle for r in s.step()]
        self.finished.extend(done)
        return done


def _free_tcp_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports (checked by binding each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65536:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def test_dp_ranks_publish_per_rank_streams_at_offset_ports():
    front = _RoundRobinFront([TreeServer(16, capacity=768, host_tokens=1024, seed=r) for r in range(2)])
    base = _free_tcp_ports(4)  # pub: base, base + 1; replay: base + 2, base + 3
    config = KVEventsConfig(
        publisher="zmq",
        endpoint=f"tcp://*:{base}",
        replay_endpoint=f"tcp://*:{base + 2}",
        block_hash="sha256_cbor",
        hash_seed="0",
    )
    mirrors = [Mirror(f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{base + 2 + r}") for r in range(2)]
    streams = attach_kv_events(front, config)
    _joined()
    try:
        run_workload(front, DEMO)
        streams.flush()
        for rank, (m, s) in enumerate(zip(mirrors, front.schedulers, strict=True)):
            m.drain()
            assert m.ranks == {rank}, "each stream stamps its rank"
            assert m.blocks == cached_blocks(s.tree)
            assert s.tree.stats.evicted_tokens > 0
        assert mirrors[0].blocks != mirrors[1].blocks
    finally:
        streams.close()
        for m in mirrors:
            m.close()
