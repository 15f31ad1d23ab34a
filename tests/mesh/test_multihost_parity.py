"""Transformers parity across two processes: a tiny Llama (8 query heads over 2 KV heads) served at
tp 8 over 2 processes x 4 CPU devices gives Transformers' greedy tokens and logits, on one cache
small enough that the harness's two rounds reuse prefixes, prefill in chunks, evict and retract.
Both processes finish the same requests with the same tokens, compare state digests at every
step, and end leak free.

Run as a program (``python -m tests.mesh.test_multihost_parity DIR``) it is one process of the group.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.mesh.multihost_group import assert_all_ok, join, parse_group_args, run_group
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    assert_matches_transformers,
    random_transformers_model,
    save_pretrained,
    serve_two_rounds,
    transformers,
)
from tests.serve.test_parity_transformers import COMMON, FAMILIES

MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def llama8(tmp_path_factory) -> tuple[object, str]:
    cls, extra = FAMILIES["llama"]
    config = getattr(transformers, cls)(**{**COMMON, "num_attention_heads": 8}, **extra)
    hf = random_transformers_model(config)
    return hf, str(save_pretrained(hf, tmp_path_factory, "llama8"))


def test_llama_at_tp_8_over_two_processes_matches_transformers(llama8):
    from kvjax.serve.serving_req import ServingReq

    hf, directory = llama8
    reports = assert_all_ok(run_group(["-m", "tests.mesh.test_multihost_parity", directory], devices=4, timeout=300))
    assert reports[0]["outputs"] == reports[1]["outputs"]
    for r in reports:
        assert r["leak_free"] and r["digest_checks"] > 0, r
        assert r["cached_tokens"] > 0 and r["evicted_tokens"] > 0 and r["retractions"] > 0, r
    done = {}
    for rid, item in reports[0]["requests"].items():
        req = ServingReq(rid, item["prompt"], max_new_tokens=MAX_NEW)
        req.output_ids.extend(item["output"])
        req.logits = [np.asarray(row, np.float32) for row in item["logits"]]
        done[rid] = req
    assert sorted(done) == ["a", "b", "c", "chat1", "chat2", "d"]
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=ATOL)


def _serve(directory: str) -> dict:
    args, _ = parse_group_args()
    group = join(args)
    from kvjax import CacheConfig, build_kv_cache
    from kvjax.multihost.front import MultiProcessFront
    from kvjax.multihost.mesh import group_tp_mesh
    from kvjax.serve.checkpoint import load_checkpoint
    from kvjax.serve.scheduler import Scheduler

    model = load_checkpoint(directory)
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        tp_size=8,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
    )
    cache = build_kv_cache(model.spec, config, mesh=group_tp_mesh(8))
    sched = Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        agreement=group.agreement(),
    )
    front = MultiProcessFront(sched, group.channel, check_agreement=True)
    serve_two_rounds(front, MAX_NEW)  # type: ignore[arg-type]  # a front serves like a scheduler
    st = sched.stats
    return {
        "outputs": {str(r.rid): list(r.output_ids) for r in front.finished},
        "requests": {
            str(r.rid): {
                "prompt": [int(t) for t in r.origin_input_ids],
                "output": list(r.output_ids),
                "logits": [np.asarray(row).tolist() for row in r.logits],
            }
            for r in front.finished
        },
        "leak_free": front.leak_free(),
        "digest_checks": front.digest_checks,
        "cached_tokens": st.cached_tokens,
        "evicted_tokens": st.evicted_tokens,
        "retractions": st.retractions,
    }


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1])))
