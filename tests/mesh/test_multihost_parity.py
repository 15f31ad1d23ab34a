"""Transformers parity across two processes, on one cache small enough that the harness's two
rounds reuse prefixes, prefill in chunks, evict and retract:

* full attention: a tiny Llama (8 query heads over 2 KV heads) at tp 8 over 2 processes x 4 CPU
  devices;
* hybrid: the tiny Gemma 3 of ``test_parity_gemma3`` (sliding-window and full layers, a hybrid
  SWA cache: two pools, the SWA tree and its serving extension) at tp 4 over 2 processes x 2
  devices (its 4 query heads split 4 ways, its 2 KV heads replicated to 4).

Each gives Transformers' greedy tokens and logits; both processes finish the same requests with
the same tokens, compare state digests at every step, and end leak free.

Run as a program (``python -m tests.mesh.test_multihost_parity DIR TP MAX_NEW``) it is one process
of the group.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.mesh.multihost_group import assert_all_ok, join, parse_group_args, run_group
from tests.mesh.tp_serving import family_config
from tests.serve import swa_parity
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    assert_matches_transformers,
    random_transformers_model,
    save_pretrained,
    serve_two_rounds,
)

MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def llama8(tmp_path_factory) -> tuple[object, str]:
    hf = random_transformers_model(family_config("llama", num_attention_heads=8))
    return hf, str(save_pretrained(hf, tmp_path_factory, "llama8"))


def test_llama_at_tp_8_over_two_processes_matches_transformers(llama8):
    hf, directory = llama8
    reports = _serve_over_two_processes(directory, tp=8, max_new=MAX_NEW)
    assert all(r["tree"] == "RadixCache" for r in reports), reports
    assert_matches_transformers(hf, _finished(reports[0], MAX_NEW), max_new=MAX_NEW, atol=ATOL)


def test_gemma3_hybrid_swa_at_tp_4_over_two_processes_matches_transformers(tmp_path_factory):
    hf = random_transformers_model(family_config("gemma3"))
    directory = str(save_pretrained(hf, tmp_path_factory, "gemma3"))
    max_new = swa_parity.MAX_NEW
    reports = _serve_over_two_processes(directory, tp=4, max_new=max_new)
    assert all(r["tree"] == "SWARadixCache" for r in reports), reports
    assert_matches_transformers(hf, _finished(reports[0], max_new), max_new=max_new, atol=swa_parity.LOGIT_ATOL)


def _serve_over_two_processes(directory: str, *, tp: int, max_new: int) -> list[dict]:
    """Serve the two rounds at ``tp`` over 2 processes of ``tp / 2`` devices; their reports, each
    checked: equal outputs, digests compared, leak free, reuse, evictions and retractions."""
    args = ["-m", "tests.mesh.test_multihost_parity", directory, str(tp), str(max_new)]
    reports = assert_all_ok(run_group(args, devices=tp // 2, timeout=300))
    assert reports[0]["outputs"] == reports[1]["outputs"]
    for r in reports:
        assert r["leak_free"] and r["digest_checks"] > 0, r
        assert r["cached_tokens"] > 0 and r["evicted_tokens"] > 0 and r["retractions"] > 0, r
    return reports


def _finished(report: dict, max_new: int) -> dict:
    """The finished requests of one process's report, with their tokens and logits, by name."""
    from kvjax.serve.serving_req import ServingReq

    done = {}
    for rid, item in report["requests"].items():
        req = ServingReq(rid, item["prompt"], max_new_tokens=max_new)
        req.output_ids.extend(item["output"])
        req.logits = [np.asarray(row, np.float32) for row in item["logits"]]
        done[rid] = req
    assert sorted(done) == ["a", "b", "c", "chat1", "chat2", "d"]
    return done


def _serve(directory: str, tp: int, max_new: int) -> dict:
    args, _ = parse_group_args()
    group = join(args)
    from kvjax import CacheConfig, build_kv_cache
    from kvjax.serve.checkpoint import load_checkpoint
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.multihost.mesh import group_tp_mesh
    from kvjax.serve.scheduler import Scheduler

    model = load_checkpoint(directory)
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        tp_size=tp,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
    )
    cache = build_kv_cache(model.spec, config, mesh=group_tp_mesh(tp))
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
    serve_two_rounds(front, max_new)  # type: ignore[arg-type]  # a front serves like a scheduler
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
        "tree": type(cache.tree_cache).__name__,
        "leak_free": front.leak_free(),
        "digest_checks": front.digest_checks,
        "cached_tokens": st.cached_tokens,
        "evicted_tokens": st.evicted_tokens,
        "retractions": st.retractions,
    }


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
