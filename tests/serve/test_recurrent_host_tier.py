"""The host tier (HiCache) over recurrent state, served: Qwen3-Next and Nemotron-H tiny random-weight
checkpoints with ``enable_hierarchical_cache`` and a device pool small enough that prefixes (their
KV and their checkpoints) are evicted to the host and loaded back at admission.

Served in batches (``serve_batches_through_the_host``: each batch evicts the one before to the
host; the chat's second turn then comes back from the host), with chunked prefill of 8 tokens,
and retraction (a batch larger than the pool). Each request gives Transformers' greedy tokens and
logits (2e-4 for Qwen3-Next, 1e-4 against Nemotron-H's full forward, as the recurrent parity tests
allow); host hits and loads happened (asserted), and afterwards the device pools, the state slots
and both host pools balance (leak-free). One model per module, shared by its cases.
"""

from __future__ import annotations

import pytest

from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.parity_harness import (
    assert_matches_transformers,
    build_scheduler,
    host_tier_scheduler,
    prompts,
    serve_batches_through_the_host,
    serve_recurrent,
)
from tests.serve.test_parity_nemotron_h import assert_matches_full_forward, nemotron_h_checkpoint
from tests.serve.test_parity_qwen3_next import _hf_model

MAX_NEW = 6


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return _hf_model(tmp_path_factory, "qwen3_next_host")


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    return nemotron_h_checkpoint(tmp_path_factory, "nemotron_h_host")


def _scheduler(loaded, **extra) -> Scheduler:
    return host_tier_scheduler(loaded, max_batch_size=2, max_mamba_cache_size=12, **extra)


def _host_tier(sched: Scheduler) -> HostTierExtension:
    return next(e for e in sched.extensions if isinstance(e, HostTierExtension))


def assert_leak_free(sched: Scheduler) -> None:
    """Device KV, the state slots (requests' and checkpoints') and both host pools balance."""
    tree = sched.cache.tree_cache
    assert isinstance(tree, HiMambaRadixCache)
    tree.check_transfers(wait=True)
    assert sched.leak_free()
    table = sched.cache.req_to_token_pool
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    assert tree.host_balanced()
    tree.sanity_check()


def _serve(loaded) -> tuple[Scheduler, dict[str, ServingReq]]:
    sched = _scheduler(loaded)
    done = serve_batches_through_the_host(sched, MAX_NEW)
    ext = _host_tier(sched)
    tree = sched.cache.tree_cache
    assert ext.loads > 0 and ext.loaded_tokens > 0, "no prefix came back from the host"
    assert tree.mamba.backups > 0 and tree.mamba.loads > 0, "no checkpoint went to the host and back"
    assert (done["chat2"].first_cached_tokens or 0) >= len(prompts()["chat1"]), "turn 2 resumes from the host"
    assert_leak_free(sched)
    return sched, done


def test_qwen3_next_prefixes_and_checkpoints_come_back_from_the_host(qwen3_next):
    hf, loaded = qwen3_next
    _, done = _serve(loaded)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=2e-4)


def test_qwen3_next_retraction_and_evicted_checkpoints_with_the_host_tier(qwen3_next):
    """The two rounds of the parity tests on a pool of 56 tokens and 6 state slots: KV and
    checkpoints evicted (to the host), requests retracted, prefixes loaded back."""
    hf, loaded = qwen3_next
    sched, done = serve_recurrent(
        loaded,
        MAX_NEW,
        max_total_tokens=56,
        max_running_requests=4,
        max_mamba_cache_size=6,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    ext = _host_tier(sched)
    assert sched.stats.retractions > 0 and sched.stats.evicted_tokens > 0
    assert ext.loads > 0 and sched.cache.tree_cache.mamba.loads > 0
    assert_leak_free(sched)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=2e-4)


@pytest.mark.slow  # the suite's time budget: the second CI stage runs it
def test_qwen3_next_page_4_with_the_extra_buffer_through_the_host(qwen3_next):
    """Page 4 with the extra buffer: checkpoints are tracked ping-pong slots donated at page
    boundaries (no queued copy), backed up and loaded back the same way."""
    hf, loaded = qwen3_next
    sched = build_scheduler(
        loaded,
        max_batch_size=2,
        page_size=4,
        enable_mamba_extra_buffer=True,
        max_mamba_cache_size=16,
        max_total_tokens=64,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
    )
    done = serve_batches_through_the_host(sched, MAX_NEW)
    assert _host_tier(sched).loads > 0 and sched.cache.tree_cache.mamba.loads > 0
    assert (done["chat2"].first_cached_tokens or 0) >= 16
    assert_leak_free(sched)
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=2e-4)


def test_nemotron_h_prefixes_and_checkpoints_come_back_from_the_host(nemotron_h):
    hf, loaded = nemotron_h
    _, done = _serve(loaded)
    assert_matches_full_forward(hf, done, max_new=MAX_NEW)


def test_generate_command_serves_a_recurrent_checkpoint_with_the_host_tier(tmp_path, capsys):
    """``python -m kvjax generate --model QWEN3_NEXT_DIR --enable-hierarchical-cache``: a 64-token
    pool holds one prompt; the third prompt's 48-token prefix (chunk-end checkpoints at 16, 32,
    48) comes back from the host, and the tokens are those served without the host tier."""
    from kvjax.cli import main
    from kvjax.serve.checkpoint import save_checkpoint
    from tests.serve.random_workloads import model

    spec, _, params = model("qwen3-next-tiny")
    directory = str(save_checkpoint(tmp_path / "qwen3-next-tiny", spec, params))
    shared = ",".join(str(i) for i in range(1, 49))
    other = ",".join(str(i) for i in range(60, 108))
    argv = ["generate", "--model", directory, "--prompt-ids", f"{shared},1,2,3", "--prompt-ids", f"{other},5"]
    argv += ["--prompt-ids", f"{shared},7,8,9", "--max-new-tokens", "3", "--ignore-eos", "--page-size", "1"]
    argv += ["--max-total-tokens", "64", "--chunked-prefill-size", "16"]
    outputs = []
    for extra in ([], ["--enable-hierarchical-cache"]):
        assert main(argv + extra) == 0
        outputs.append(capsys.readouterr().out.strip().splitlines())
    plain, host = outputs
    assert host[:3] == plain[:3]  # the generated tokens of the three prompts
    assert plain[3].startswith("cached tokens 0 of 151") and host[3].startswith("cached tokens 48 of 151")
