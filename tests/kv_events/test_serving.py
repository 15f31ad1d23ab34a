"""The serving loop publishes its KV events: the demo's ``serve`` over the tiny model (a real
``Scheduler``, the host tier, a pool small enough to evict and retract) with ``--kv-events-config``'s
configuration, a real subscriber rebuilding the tree's cached blocks from the stream; and the
command line's flag refuses a bad configuration naming the field, before jax starts."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvjax.kv_events.blocks import cached_blocks  # noqa: E402
from kvjax.kv_events.config import KVEventsConfig  # noqa: E402
from tests.kv_events.vllm_layout import Mirror  # noqa: E402
from tests.workloads import SMALL  # noqa: E402

# Whole pages beyond the shared prompts (questions and turns of 24 tokens at page 16, 40 output
# tokens), a pool of 192 tokens that cannot hold them all: device eviction, backups to the host,
# load-backs, and decode retractions.
WORKLOAD = dataclasses.replace(SMALL, groups=3, question_tokens=24, turns=3, turn_tokens=24, output_tokens=40)


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_demo_server_publishes_what_its_tree_caches(tmp_path, page_size):
    from kvjax.demo import serve
    from kvjax.serve.scheduler import Scheduler

    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    config = KVEventsConfig(publisher="zmq", endpoint=pub, replay_endpoint=replay, topic="kv")
    mirror = Mirror(pub, replay, topic="kv")
    try:
        server, _ = serve(
            WORKLOAD,
            page_size=page_size,
            max_total_tokens=192,
            enable_hierarchical_cache=True,
            overlap=True,
            kv_events=config,
        )
        assert isinstance(server, Scheduler)
        # serve closed the publisher (no replay now): the stream must have arrived whole, live
        mirror.drain(1000, replay_tail=False)
        assert mirror.replayed == 0 and mirror.last_seq == mirror.batches - 1
        assert mirror.blocks == cached_blocks(server.tree)
        assert {m for m, _ in mirror.blocks} == {"GPU", "CPU_TIER1"}
        assert server.stats.evicted_tokens > 0 and server.stats.retractions > 0
        streams = getattr(server, "kv_event_streams")  # noqa: B009 - set by serve
        assert streams.published_batches == mirror.batches > 1
    finally:
        mirror.close()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('{"publisher": "zmq", "buffer_step": 5}', ["buffer_step=5", "buffer_steps"]),
        ('{"publisher": "zmq", "block_hash": "sha256_cbor"}', ["hash_seed=None", "PYTHONHASHSEED"]),
    ],
    ids=["unknown-field", "sha256_cbor-without-a-seed"],
)
def test_the_command_line_refuses_a_bad_configuration_by_field(config, expected):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run(
        [sys.executable, "-m", "kvjax", "demo", "--kv-events-config", config],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert out.returncode == 2
    assert "--kv-events-config" in out.stderr and all(e in out.stderr for e in expected), out.stderr
    assert "Traceback" not in out.stderr


def test_dp_ranks_of_a_real_server_publish_one_stream_each(tmp_path):
    """Two DP ranks (``DPScheduler``: a scheduler and a cache per rank, the demo's settings),
    each publishing at the configured address plus ``_dp{rank}``, every batch stamped with its
    rank; each rank's subscriber rebuilds that rank's tree."""
    from kvjax.dp.scheduler import DPScheduler
    from kvjax.serve.kv_events import attach_kv_events
    from kvjax.serve.model import init_params
    from kvjax.serve.workload import run_workload
    from kvjax.spec import ModelSpec
    from tests.serve.dp_serving import dp2_config

    spec = ModelSpec.preset("tiny")
    config = dp2_config().replace(max_total_tokens=192)
    front = DPScheduler.build(spec, config, init_params(spec, seed=0), policy="round_robin")
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    events = KVEventsConfig(
        publisher="zmq", endpoint=pub, replay_endpoint=replay, block_hash="sha256_cbor", hash_seed="0"
    )
    mirrors = [Mirror(f"{pub}_dp{r}" if r else pub, f"{replay}_dp{r}" if r else replay) for r in range(2)]
    streams = attach_kv_events(front, events)
    try:
        run_workload(front, WORKLOAD)
        streams.flush()
        for rank, (mirror, scheduler) in enumerate(zip(mirrors, front.schedulers, strict=True)):
            mirror.drain()
            assert mirror.ranks == {rank}
            assert mirror.blocks == cached_blocks(scheduler.tree)
            assert scheduler.stats.evicted_tokens > 0
    finally:
        streams.close()
        for m in mirrors:
            m.close()
