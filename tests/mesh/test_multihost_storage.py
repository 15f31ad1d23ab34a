"""The storage tier across two processes: storage hits and prefetched pages are agreed (MIN over
processes, as SGLang) before they change a tree, so a process whose store answers fewer pages
keeps every tree equal.

Two processes of one group, each serving the tiny model on its own CPU device (the agreement does
not depend on the mesh). Each process has its own store
folder (a host's local disk). A first round writes the prompts' pages to storage; a second round, on a
fresh cache over the same folders, serves the same prompts, whose pages then come from storage.
In that round process 1's store (``ScriptedStore``, opened as the tier's store) answers late and
with fewer pages: some entries it never finds (fewer storage hits), others it finds when asked
what it holds but not when the prefetch reads them (fewer pages received). Every step's digests
are compared (the front's agreement check); the tokens are those of one process alone;
both processes end leak free with a balanced host pool, and process 0 was held back.

The same two rounds at tp 2 over the two processes (one mesh, one device each: the tiny model's
two KV heads split across the processes): each process backs up, stores and reads back only its
own device's head, under its own rank's key in its own folder, and both serve the tokens of one
process with two devices, with as many pages from storage.

Run as a program (``python -m tests.mesh.test_multihost_storage DIR MODE [TP]``; MODE ``group`` or
``single``) it serves both rounds as one process of the group, or alone (the tests serve the
single-process runs in their own process).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

from tests.mesh.multihost_group import assert_all_ok, join, parse_group_args, run_group

PAGE = 4
PROMPTS = 4
PROMPT_TOKENS = 41  # 10 whole pages before the last token (a match never covers the last token)
DELAY_S = 0.02  # process 1's reads land this late


def _single(tmp_path: Any, tp: int) -> dict:
    """Both rounds served by one process alone at ``tp`` (this one: the mesh stage's devices), its
    report as the program prints it."""
    return json.loads(json.dumps(_serve(str(tmp_path / "single"), "single", tp)))


def test_storage_hits_and_prefetches_are_agreed_with_a_short_store_on_one_process(tmp_path):
    single = _single(tmp_path, tp=1)
    reports = assert_all_ok(
        run_group(["-m", "tests.mesh.test_multihost_storage", str(tmp_path), "group"], devices=1, timeout=120)
    )
    assert single["prefetched_tokens"] > 0, single
    for r in reports:
        assert r["outputs"] == single["outputs"]
        assert r["leak_free"] and r["host_balanced"] and r["digest_checks"] > 0, r
    # every process inserted the same pages: the shortest run any of them had
    assert reports[0]["prefetched_tokens"] == reports[1]["prefetched_tokens"] > 0, reports
    assert reports[0]["prefetched_tokens"] < single["prefetched_tokens"], "process 1's short store did not count"
    # the script mattered on both counts: fewer hits and fewer pages received
    assert reports[1]["script"]["never"] > 0 and reports[1]["script"]["vanished"] > 0, reports[1]
    assert reports[0]["pages_held_back"] > 0 and reports[1]["pages_held_back"] == 0, reports


def test_a_pool_whose_heads_span_the_processes_stores_each_processs_heads_under_its_rank(tmp_path):
    single = _single(tmp_path, tp=2)
    reports = assert_all_ok(
        run_group(["-m", "tests.mesh.test_multihost_storage", str(tmp_path), "group", "2"], devices=1, timeout=180)
    )
    assert single["prefetched_tokens"] > 0 and single["stored_ranks"] == [0, 1], single
    for process, r in enumerate(reports):
        assert r["outputs"] == single["outputs"]
        assert r["leak_free"] and r["host_balanced"] and r["digest_checks"] > 0, r
        assert r["prefetched_tokens"] == single["prefetched_tokens"], (r, single)  # every page back
        assert r["stored_ranks"] == [process], r  # its own device's head only


class Delayed:
    """A read future that finishes ``DELAY_S`` after it was started (tensorstore's future API)."""

    def __init__(self, future: Any) -> None:
        self.future = future
        self.ready_at = time.monotonic() + DELAY_S

    def done(self) -> bool:
        return time.monotonic() >= self.ready_at and bool(self.future.done())

    def result(self) -> Any:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self.future.result()

    def cancel(self) -> None:
        self.future.cancel()


class ScriptedStore:
    """Process 1's store: every read lands late; an entry whose key's last hex digit is 0 mod 5
    is never found, one that is 1 mod 5 is found once (the question what the store holds) and
    not when read again (the prefetch). ``script`` counts the reads of each kind."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.script: Counter[str] = Counter()
        self._reads: Counter[str] = Counter()

    def read(self, key: str) -> Delayed:
        self._reads[key] += 1
        kind = int(key[-1], 16) % 5
        if kind == 0 or (kind == 1 and self._reads[key] > 1):
            self.script["never" if kind == 0 else "vanished"] += 1
            return Delayed(self.inner.read(key + ".absent"))
        return Delayed(self.inner.read(key))

    def write(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.write(*args, **kwargs)


def _serve(root: str, mode: str, tp: int = 1) -> dict:
    group = None
    if mode == "group":
        args, _ = parse_group_args(sys.argv[3:])
        group = join(args)
    import tensorstore as ts

    from kvjax.demo import MAX_BATCH, demo_cache
    from kvjax.multihost.channel import LoopbackChannel
    from kvjax.serve.host_tier import HostTierExtension
    from kvjax.serve.model import init_params
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.scheduler import Scheduler
    from kvjax.serve.serving_req import ServingReq
    from kvjax.spec import ModelSpec
    from kvjax.tiers.storage import StorageTier

    spec = ModelSpec.preset("tiny")
    params = init_params(spec, seed=0)
    folder = f"{root}/p{group.process_id}" if group is not None else root
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 256, PROMPT_TOKENS)] for _ in range(PROMPTS)]
    channel: Any = LoopbackChannel() if group is None else group.channel
    report: dict[str, Any] = {"outputs": {}, "leak_free": True, "host_balanced": True, "digest_checks": 0}

    def serve_round(name: str, scripted: bool) -> Any:
        cache = demo_cache(
            spec=spec,
            group=group if tp > 1 else None,  # tp 1: each process on its own device
            tp_size=tp,
            page_size=PAGE,
            max_total_tokens=512,
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            hicache_storage_dir=folder,
            hicache_storage_model_fingerprint="tiny-seed-0",
            hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_prefetch_threshold=PAGE,
        )
        link = cache.tree_cache.storage
        store = None
        if scripted:  # the tier opens the scripted store instead of the folder
            store = ScriptedStore(ts.KvStore.open({"driver": "file", "path": folder + "/"}).result())
            tier = link.storage
            partial = tier.partial_shards
            link.storage = StorageTier(store, key=tier.storage_key, shards=tier.shards, partial_shards=partial)
        agreement = None if group is None else group.agreement()
        sched = Scheduler(spec, cache, params, max_batch_size=MAX_BATCH, agreement=agreement)
        front = MultiProcessFront(sched, channel, check_agreement=True)
        front.run([ServingReq(f"{name}{i}", p, max_new_tokens=3) for i, p in enumerate(prompts)])
        cache.tree_cache.check_transfers(wait=True)  # host copies land, their storage writes start
        link.check_writes(wait=True)
        host = next(e for e in sched.extensions if isinstance(e, HostTierExtension))
        report["outputs"].update({str(r.rid): list(r.output_ids) for r in front.finished})
        report["leak_free"] &= front.leak_free()
        report["host_balanced"] &= host.host_balanced()
        report["digest_checks"] += front.digest_checks
        return link, store

    serve_round("write", False)
    link, store = serve_round("read", tp == 1 and group is not None and group.process_id == 1)
    report.update(
        prefetched_tokens=link.prefetched_tokens,
        pages_held_back=link.pages_held_back,
        script=dict(store.script) if store is not None else {},
        stored_ranks=sorted(_stored_ranks(folder)),
    )
    return report


def _stored_ranks(folder: str) -> set[int]:
    """The TP ranks whose entries the store folder holds (each key's ``key.json`` record)."""
    import glob

    return {json.load(open(path))["tp_rank"] for path in glob.glob(f"{folder}/*/key.json")}


if __name__ == "__main__":
    root, mode, *rest = sys.argv[1:]
    tp = int(rest[0]) if rest and not rest[0].startswith("-") else 1
    print(json.dumps(_serve(root, mode, tp)))
