"""Transformers parity across two processes, on one cache small enough that the harness's two
rounds reuse prefixes, prefill in chunks, evict and retract:

* full attention: a tiny Llama (8 query heads over 2 KV heads) at tp 8 over 2 processes x 4 CPU
  devices;
* hybrid: the tiny Gemma 3 of ``test_parity_gemma3`` (sliding-window and full layers, a hybrid
  SWA cache: two pools, the SWA tree and its serving extension) at tp 4 over 2 processes x 2
  devices (its 4 query heads split 4 ways, its 2 KV heads replicated to 4);
* recurrent: the tiny Qwen3-Next of ``tests/mesh/qwen3_next_tp.py`` (gated delta net layers, their
  state split by key heads) at tp 4 over 2 processes x 2 devices, 6 state slots: checkpoints forked,
  evicted and requests retracted on both processes alike.

Each gives Transformers' greedy tokens and logits; both processes finish the same requests with
the same tokens, compare state digests at every step, and end leak free.

Run as a program (``python -m tests.mesh.test_multihost_parity DIR TP MAX_NEW``) it is one process
of the group.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.mesh.multihost_group import assert_all_ok, finished_requests, join_and_load, request_records, run_group
from tests.mesh.tp_serving import family_config
from tests.serve import swa_parity
from tests.serve.parity_harness import (
    CHUNK,
    assert_matches_transformers,
    parity_cache_config,
    saved_transformers_model,
    serve_two_rounds,
)

MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def llama8(tmp_path_factory) -> tuple[object, str]:
    hf, directory = saved_transformers_model(family_config("llama", num_attention_heads=8), tmp_path_factory, "llama8")
    return hf, str(directory)


def test_llama_at_tp_8_over_two_processes_matches_transformers(llama8):
    hf, directory = llama8
    reports = _serve_over_two_processes(directory, tp=8, max_new=MAX_NEW)
    assert all(r["tree"] == "RadixCache" for r in reports), reports
    assert_matches_transformers(hf, finished_requests(reports[0], MAX_NEW), max_new=MAX_NEW, atol=ATOL)


def test_gemma3_hybrid_swa_at_tp_4_over_two_processes_matches_transformers(tmp_path_factory):
    hf, directory = saved_transformers_model(family_config("gemma3"), tmp_path_factory, "gemma3")
    max_new = swa_parity.MAX_NEW
    reports = _serve_over_two_processes(str(directory), tp=4, max_new=max_new)
    assert all(r["tree"] == "SWARadixCache" for r in reports), reports
    assert_matches_transformers(hf, finished_requests(reports[0], max_new), max_new=max_new, atol=swa_parity.LOGIT_ATOL)


def test_qwen3_next_recurrent_state_at_tp_4_over_two_processes_matches_transformers(tmp_path_factory):
    from tests.mesh import qwen3_next_tp
    from tests.serve.parity_harness import TINY_CONFIG, transformers

    config = transformers.Qwen3NextConfig(**TINY_CONFIG, **qwen3_next_tp.LAYERS, **qwen3_next_tp.HEADS[4])
    hf, directory = saved_transformers_model(config, tmp_path_factory, "qwen3_next4", seed=qwen3_next_tp.MODEL_SEED)
    reports = _serve_over_two_processes(str(directory), tp=4, max_new=MAX_NEW)
    assert all(r["tree"] == "MambaRadixCache" for r in reports), reports
    assert_matches_transformers(hf, finished_requests(reports[0], MAX_NEW), max_new=MAX_NEW, atol=ATOL)


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


def _serve(directory: str, tp: int, max_new: int) -> dict:
    group, model = join_and_load(directory)
    from kvjax import build_kv_cache
    from kvjax.serve.multihost.front import MultiProcessFront
    from kvjax.serve.multihost.mesh import group_tp_mesh
    from kvjax.serve.scheduler import Scheduler

    if model.spec.recurrent_layer_ids():  # small enough to evict checkpoints and retract (6 state slots)
        sizes = dict(max_total_tokens=56, max_running_requests=4, max_mamba_cache_size=6)
    else:
        sizes = dict(max_total_tokens=64, max_running_requests=8)
    config = parity_cache_config(tp_size=tp, page_size=1, **sizes)
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
        "requests": request_records(front.finished),
        "tree": type(cache.tree_cache).__name__,
        "leak_free": front.leak_free(),
        "digest_checks": front.digest_checks,
        "cached_tokens": st.cached_tokens,
        "evicted_tokens": st.evicted_tokens,
        "retractions": st.retractions,
    }


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
