"""Serving under decode context parallelism from the entry points, and DCP's bad input.

DCP divides the TP group (``--tp T --dcp D``: ``T`` devices, ``("tp", "dcp")`` = ``(T / D, D)``).
``generate --tp 4 --dcp 4`` gives the single-device tokens; ``demo --tp 2 --dcp 2`` is leak free
with cold == warm; KV events carry the striped page as their block size. A DCP size that does not
divide the TP size, a TP size beyond the devices, a DCP size that disagrees with the mesh, or one
that comes without a mesh is one ``ConfigError`` naming the options and the fix, raised before
anything is allocated; combinations DCP does not serve are refused by name. ``plan`` at tp 8 x
dcp 8 on a v5e-8 holds 8 times the tokens of tp 8 with the weights split over the 8 chips.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from kvjax import CacheConfig, ModelSpec, build_kv_cache
from kvjax.cli import main
from kvjax.errors import ConfigError
from kvjax.mesh_check import make_serving_mesh
from kvjax.radix.events import BlockStored
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq

GENERATE = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3,4,5,6,7,8,9", "--max-new-tokens", "4", "--json"]


def test_generate_under_dcp_gives_the_single_device_tokens(capsys):
    assert main([*GENERATE, "--page-size", "2"]) == 0
    single = json.loads(capsys.readouterr().out)["outputs"]
    assert main([*GENERATE, "--page-size", "2", "--tp", "4", "--dcp", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"] == single


def test_demo_at_tp_2_dcp_2_is_leak_free_and_cold_equals_warm(capsys):
    argv = ["demo", "--tp", "2", "--dcp", "2", "--groups", "1", "--prompts-per-group", "2", "--chats", "1"]
    assert main([*argv, "--turns", "2", "--system-tokens", "32", "--output-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["leak_free"] and report["cold_equals_warm"] and report["cached_tokens"] > 0


def test_kv_events_use_the_striped_page_as_their_block_size():
    spec = ModelSpec.preset("tiny")
    events: list = []
    config = CacheConfig(
        max_total_tokens=256, max_running_requests=4, page_size=2, tp_size=2, dcp_size=2, context_length=128
    )
    cache = build_kv_cache(
        spec, config, mesh=make_serving_mesh(2, dcp_size=2, devices=jax.devices()), event_sink=events
    )
    sched = Scheduler(spec, cache, init_params(spec), max_batch_size=2)
    sched.run([ServingReq("a", list(range(1, 11)), max_new_tokens=2)])
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and {e.block_size for e in stored} == {4}
    assert all(len(e.token_ids) == 4 * len(e.block_hashes) for e in stored)
    assert sched.leak_free()


def _refused(error: type[Exception], match: str, make) -> None:
    before = len(jax.live_arrays())
    with pytest.raises(error, match=match):
        make()
    assert len(jax.live_arrays()) == before, "nothing is allocated before the error"


def test_dcp_that_does_not_divide_tp_or_a_tp_beyond_the_devices_is_one_clear_error():
    _refused(
        ConfigError,
        r"dcp_size=3: decode context parallelism divides the TP group, and 3 does not divide tp_size 4; "
        r"use dcp_size 1, 2 or 4, or a tp_size that 3 divides",
        lambda: make_serving_mesh(4, dcp_size=3),
    )
    _refused(
        ConfigError,
        r"dcp_size=8: .* 8 does not divide tp_size 4",
        lambda: CacheConfig(tp_size=4, dcp_size=8),
    )
    _refused(ConfigError, r"tp_size=16: only 8 cpu device\(s\)", lambda: make_serving_mesh(16, dcp_size=8))
    mesh = make_serving_mesh(8, dcp_size=8)
    assert dict(mesh.shape) == {"tp": 1, "dcp": 8} and mesh.devices.size == 8


def test_dcp_that_disagrees_with_the_mesh_or_has_none_is_refused_before_allocating():
    tiny = ModelSpec.preset("tiny")
    config = CacheConfig(max_total_tokens=256, max_running_requests=4, tp_size=4, dcp_size=4)
    two = make_serving_mesh(4, dcp_size=2, devices=jax.devices())
    _refused(
        ConfigError,
        r"the mesh's 'dcp' axis has 2 device\(s\) but KV is striped over 4",
        lambda: build_kv_cache(tiny, config, mesh=two),
    )
    _refused(
        ConfigError,
        r"dcp_size=4: striping each request's KV over DCP ranks needs a mesh",
        lambda: build_kv_cache(tiny, config),
    )


def test_what_dcp_does_not_serve_is_refused_by_name():
    mesh = make_serving_mesh(2, dcp_size=2, devices=jax.devices())
    base = dict(max_total_tokens=512, max_running_requests=4, tp_size=2, dcp_size=2)
    tiny = ModelSpec.preset("tiny")
    storage = CacheConfig(
        **base,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir="x",
        hicache_storage_model_fingerprint="weights",
    )
    _refused(
        ConfigError,
        r"the storage tier \(L3\) with dcp_size 2 is served for an MLA latent only, as in SGLang",
        lambda: build_kv_cache(tiny, storage, mesh=mesh),
    )
    hybrid = ModelSpec.preset("qwen3-next-80b-a3b")
    _refused(  # its tree's page is the striped page: recurrent checkpoints need the extra buffer
        ConfigError,
        "set enable_mamba_extra_buffer True",
        lambda: build_kv_cache(hybrid, CacheConfig(**base), mesh=mesh),
    )


def test_the_command_line_names_the_flag(capsys):
    assert main([*GENERATE, "--tp", "4", "--dcp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--dcp 3" in err and "does not divide --tp 4" in err, err
    np.testing.assert_equal(len(jax.devices()), 8)


def test_plan_dcp_prints_the_striped_pool_and_each_devices_rows(capsys):
    argv = ["plan", "--model", "deepseek-v3", "--tpu", "v5e", "--chips", "8", "--tp", "8", "--page-size", "16"]
    argv += ["--weights-bytes", "20GB"]
    assert main([*argv, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["max_total_tokens"]
    assert main([*argv, "--dcp", "8", "--json"]) == 0
    striped = json.loads(capsys.readouterr().out)
    assert striped["max_total_tokens"] == 8 * alone and striped["alloc_page_size"] == 128
    assert main([*argv, "--dcp", "8", "--context", "100000"]) == 0
    text = capsys.readouterr().out
    assert f"{alone:,} token rows per device" in text and "tp 8 (dcp 8)" in text, text
    assert "over 8 chips" in text and "1 replica" in text, text
    assert main([*argv, "--dcp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--dcp 3" in err and "--tp 8" in err, err


def test_plan_sweep_under_dcp_lists_the_tp_sizes_it_divides(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--memory", "16GiB", "--dcp", "4", "--sweep", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {row["tp"] for row in rows} == {4, 8} and not any("refused" in row for row in rows)
