"""The host tier under memory pressure across two processes: the demo workload at tp 8 over
2 processes x 4 CPU devices, with process 1's transfer completions delayed, gives the tokens of
one process with 8 devices; the digests are equal at every step, every process ends leak free
with a balanced host pool.

The host tier moves the sharded pools' pages shard by shard (``kvjax.tiers.head_shards``); the
delay is injected under the agreed copy engine (``kvjax.tiers.agreed_copy_engine``).

Run as a program (``python -m tests.mesh.test_multihost_host_tier DIR MODE``; MODE ``group`` or
``single``) it serves the workload as one process of the group, or alone on 8 devices (the test
serves the single-process run in its own process, which has 8 devices).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import pytest

from tests.mesh.multihost_group import assert_all_ok, join, parse_group_args, run_group
from tests.serve.parity_harness import random_transformers_model, save_pretrained, transformers
from tests.serve.test_parity_transformers import COMMON, FAMILIES

TP = 8
POOL_TOKENS = 160  # small: the workload evicts to the host and loads back
EXTRA_POLLS = 3  # process 1's delay: polls before a landed transfer reports it


@pytest.fixture(scope="module")
def llama8(tmp_path_factory) -> str:
    cls, extra = FAMILIES["llama"]
    config = getattr(transformers, cls)(**{**COMMON, "num_attention_heads": 8}, **extra)
    return str(save_pretrained(random_transformers_model(config), tmp_path_factory, "llama8"))


def test_host_tier_with_a_delayed_process_gives_the_single_process_tokens(llama8):
    # one process with 8 devices: this one (the mesh stage's), as the report a program prints
    single = json.loads(json.dumps(_serve(llama8, "single")))
    reports = assert_all_ok(
        run_group(["-m", "tests.mesh.test_multihost_host_tier", llama8, "group"], devices=4, timeout=300)
    )
    assert single["host_loaded_tokens"] > 0 and single["evicted_tokens"] > 0, single
    for r in reports:
        assert r["outputs"] == single["outputs"]
        assert r["leak_free"] and r["host_balanced"] and r["digest_checks"] > 0, r
        # The pages came back from the host on every process, each holding its own devices' heads
        # (process 0 the first KV head, replicated over its 4 devices; process 1 the second), as
        # many as one process loads: not recomputed after a failed backup.
        assert r["host_loaded_tokens"] == single["host_loaded_tokens"], (r, single)
    assert reports[0]["held_back"] > 0, "the delay on process 1 never held process 0 back"


class DelayedEngine:
    """A copy engine whose transfers report PENDING for ``extra`` more polls than they need."""

    def __init__(self, engine: Any, extra: int) -> None:
        self.engine = engine
        self.extra = extra
        self._polls: dict[int, int] = {}

    def poll(self, handle: Any, wait: bool = False) -> Any:
        from kvjax.tiers.copy_engine import TransferStatus

        status = self.engine.poll(handle, wait)
        seen = self._polls.get(id(handle), 0)
        if not wait and status is not TransferStatus.PENDING and seen < self.extra:
            self._polls[id(handle)] = seen + 1
            return TransferStatus.PENDING
        self._polls.pop(id(handle), None)
        return status

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _serve(directory: str, mode: str, tp: int = TP) -> dict:
    from kvjax.multihost.channel import LoopbackChannel
    from kvjax.serve.multihost.front import MultiProcessFront

    group = None
    if mode == "group":
        args, _ = parse_group_args(sys.argv[3:])
        group = join(args)
    from kvjax.demo import MAX_BATCH, demo_cache
    from kvjax.serve.checkpoint import load_checkpoint
    from kvjax.serve.host_tier import HostTierExtension
    from kvjax.serve.scheduler import Scheduler
    from kvjax.serve.workload import Workload, run_workload

    model = load_checkpoint(directory)
    cache = demo_cache(
        spec=model.spec, group=group, tp_size=tp, enable_hierarchical_cache=True, max_total_tokens=POOL_TOKENS
    )
    agreement = None if group is None else group.agreement()
    sched = Scheduler(model.config, cache, model.params, max_batch_size=MAX_BATCH, agreement=agreement)
    host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
    if group is not None and group.process_id == 1:
        agreed: Any = cache.tree_cache.host.engine  # the agreed engine: delay what it wraps
        agreed.engine = DelayedEngine(agreed.engine, EXTRA_POLLS)
    channel: Any = LoopbackChannel() if group is None else group.channel
    front = MultiProcessFront(sched, channel, check_agreement=True)
    workload = Workload(groups=2, prompts_per_group=3, chats=1, turns=3, system_tokens=48, output_tokens=3)
    workload = dataclasses.replace(workload, vocab_size=model.config.vocab_size)
    outputs = run_workload(front, workload)
    st = sched.stats
    return {
        "outputs": outputs,
        "leak_free": front.leak_free(),
        "host_balanced": host.host_balanced(),
        "host_loaded_tokens": host.loaded_tokens,
        "evicted_tokens": st.evicted_tokens,
        "digest_checks": front.digest_checks,
        "held_back": getattr(agreement, "held_back", 0),
    }


if __name__ == "__main__":
    directory, mode, *rest = sys.argv[1:]
    tp = int(rest[0]) if mode == "single" and rest else TP  # ``DIR single 1``: one device (a smoke run)
    print(json.dumps(_serve(directory, mode, tp)))
