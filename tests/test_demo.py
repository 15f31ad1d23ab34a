"""The main job: ``python -m kvjax demo`` runs from nothing and reports a consistent, leak-free run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvjax.demo import run_demo
from tests.workloads import SMALL


def test_demo_report_is_consistent():
    report = run_demo(workload=SMALL, progress=False)
    assert report.ok and report.leak_free and report.cold_equals_warm
    assert report.requests == SMALL.num_requests
    assert report.cached_tokens > 0 and 0 < report.hit_rate < 1
    assert report.prefill_tokens_computed + report.cached_tokens == report.prompt_tokens
    assert report.cold_prefill_tokens_computed == report.prompt_tokens
    assert report.generated_tokens == SMALL.num_requests * SMALL.output_tokens


def test_python_dash_m_kvjax_demo_json_has_the_documented_keys():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvjax",
            "demo",
            "--json",
            "--groups",
            "1",
            "--prompts-per-group",
            "2",
            "--system-tokens",
            "48",
            "--chats",
            "1",
            "--turns",
            "2",
            "--output-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for key in (
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "hit_rate",
        "generated_tokens",
        "tokens_per_second",
        "evicted_tokens",
        "retractions",
        "leak_free",
        "cold_equals_warm",
    ):
        assert key in report
    assert report["requests"] == 4 and report["leak_free"] and report["cold_equals_warm"]


def test_demo_on_a_checkpoint_directory_matches_the_built_in_model(tmp_path, capsys):
    """``demo --model DIR`` serves the checkpoint's weights: the tiny preset saved to a directory
    gives the built-in model's greedy tokens, and the command reports a consistent run."""
    from kvjax import ModelSpec
    from kvjax.cli import main
    from kvjax.demo import serve
    from kvjax.serve.checkpoint import load_checkpoint, save_checkpoint
    from kvjax.serve.model import init_params

    spec = ModelSpec.preset("tiny")
    directory = save_checkpoint(tmp_path / "tiny", spec, init_params(spec))
    _, built_in = serve(SMALL)
    _, from_dir = serve(SMALL, model=load_checkpoint(directory))
    assert from_dir == built_in
    flags = ["--json", "--groups", "1", "--prompts-per-group", "2", "--system-tokens", "48", "--chats", "1"]
    assert main(["demo", *flags, "--turns", "2", "--output-tokens", "3", "--model", str(directory)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny" and report["leak_free"] and report["cold_equals_warm"]
    assert report["requests"] == 4 and report["cached_tokens"] > 0


def test_workloads_and_the_serving_commands_import_no_jax():
    """The CLI imports command modules to build its parser: building workloads and registering
    ``demo``/``generate`` must not pull in jax (that happens inside ``run``)."""
    code = (
        "import sys; import kvjax.serve.workload, kvjax.cli.demo_command, kvjax.cli.generate_command; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.slow  # three demo runs; tests/serve/test_host_tier_serving.py covers the loop in the main suite
def test_demo_with_the_host_tier_on_a_pool_smaller_than_the_working_set():
    report = run_demo(workload=SMALL, progress=False, max_total_tokens=128, enable_hierarchical_cache=True)
    assert report.ok and report.cold_equals_warm and report.leak_free and report.host_balanced
    assert report.host_pool_tokens == (128 * 2 // 16 + 1) * 16
    assert report.host_loaded_tokens is not None and report.cached_tokens_without_host_tier is not None
    assert report.cached_tokens >= report.cached_tokens_without_host_tier
    assert "host tier" in str(report)


@pytest.mark.slow  # three demo runs; tests/serve/test_storage_tier_serving.py covers the loop in the main suite
def test_demo_with_a_storage_tier_directory(tmp_path):
    report = run_demo(
        workload=SMALL,
        progress=False,
        max_total_tokens=128,
        enable_hierarchical_cache=True,
        hicache_storage=str(tmp_path / "l3"),
    )
    assert report.ok and report.cold_equals_warm and report.leak_free and report.host_balanced
    assert report.storage_prefetched_tokens is not None
    assert "from storage" in str(report)


@pytest.mark.slow  # ~15 s idle: DeepSeek-V2 serving is covered in the default suite by test_parity_deepseek_v2
def test_demo_serves_the_built_in_mla_preset():
    """``demo --model deepseek-tiny``: a DeepSeek-V2-shaped model (MLA latent pool, MoE layers) with
    random weights, served leak-free, with the radix cache changing no token."""
    from kvjax.pools import MLAKVPool
    from kvjax.serve.generate import resolve_model

    model = resolve_model("deepseek-tiny")
    assert model.config.family == "deepseek_v2" and model.config.family_config.moe is not None
    report = run_demo(workload=SMALL, progress=False, model=model, max_total_tokens=1024)
    assert report.ok and report.leak_free and report.cold_equals_warm and report.cached_tokens > 0
    from kvjax.demo import demo_cache

    assert isinstance(demo_cache(spec=model.spec, max_total_tokens=1024).pools.kv, MLAKVPool)


@pytest.mark.slow  # ~20 s idle: the families are covered in the default suite by their parity tests
@pytest.mark.parametrize("preset", ["gemma3-tiny", "mistral-swa-tiny"])
def test_demo_serves_the_built_in_sliding_window_presets(preset):
    """``demo --model gemma3-tiny`` (hybrid: SWA + full pools, with the host tier on a small pool)
    and ``demo --model mistral-swa-tiny`` (every layer sliding: one SWA pool, the pure-SWA tree)."""
    from kvjax.serve.generate import resolve_model

    model = resolve_model(preset)
    hybrid = preset == "gemma3-tiny"
    report = run_demo(workload=SMALL, progress=False, model=model, max_total_tokens=512, enable_hierarchical_cache=True)
    assert report.ok and report.leak_free and report.cold_equals_warm and report.cached_tokens > 0
    if hybrid:
        assert report.host_balanced and report.host_tier_dropped is None
    else:  # the pure-SWA tree has no host tier: the plan drops it with a warning, the report says so
        assert report.host_loaded_tokens is None and "pure_swa_radix" in (report.host_tier_dropped or "")
        assert "host tier: not attached" in str(report)


def test_the_report_says_when_the_plan_dropped_the_host_tier():
    """``demo --model mistral-swa-tiny --enable-hierarchical-cache`` ended in ``StopIteration``:
    the plan drops the host tier of a pure sliding-window tree (with a warning) and the report
    assumed it was there (the full run: ``test_demo_serves_the_built_in_sliding_window_presets``)."""
    from dataclasses import fields

    from kvjax import CacheConfig, ModelSpec, plan_kv_cache
    from kvjax.demo import DemoReport, _host_tier_warning

    plan = plan_kv_cache(
        ModelSpec.preset("mistral-swa-tiny"), CacheConfig(max_total_tokens=512, enable_hierarchical_cache=True)
    )
    assert not plan.attach_host_tier
    why = _host_tier_warning(plan)
    assert "enable_hierarchical_cache is ignored" in why and "pure_swa_radix" in why
    empty_run = {f.name: {"int": 0, "float": 0.0}[f.type] for f in fields(DemoReport) if f.type in ("int", "float")}
    empty_run.update(model="mistral-swa-tiny", platform="cpu", pool_tokens=512, leak_free=True, cold_equals_warm=True)
    report = DemoReport(**empty_run, plan_text="", tree_text="", host_tier_dropped=why)
    assert report.ok and f"host tier: not attached ({why})" in str(report)
    assert report.to_dict()["host_tier_dropped"] == why


def test_a_pool_too_small_for_a_request_is_one_error_line(capsys):
    """``demo --max-total-tokens 64 --page-size 16`` ended in ``RuntimeError: no progress``: a
    request longer than the whole pool is now refused before jax is imported, by flag."""
    from kvjax.cli import main

    assert main(["demo", "--max-total-tokens", "64", "--page-size", "16", "--groups", "1", "--chats", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "demo: error: --max-total-tokens 64: the pool (64 tokens) must hold" in err[0]
    assert "use --max-total-tokens 304 or more" in err[0]


def test_a_recurrent_model_with_the_storage_tier(tmp_path, capsys):
    """``demo --model QWEN3_NEXT_DIR --enable-hierarchical-cache --hicache-storage DIR``: the host tier
    over recurrent state (``HiMambaRadixCache``) with the storage tier behind it, its checkpoints
    stored beside the KV pages: served leak free, cold == warm, the report saying what came from
    storage."""
    import json

    from kvjax.cli import main
    from kvjax.serve.checkpoint import save_checkpoint
    from tests.serve.random_workloads import model

    spec, _, params = model("qwen3-next-tiny")
    directory = save_checkpoint(tmp_path / "qwen3-next-tiny", spec, params)
    argv = [
        "demo",
        "--model",
        str(directory),
        "--enable-hierarchical-cache",
        "--hicache-storage",
        str(tmp_path / "store"),
        "--page-size",
        "1",
        "--system-tokens",
        "32",
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["leak_free"] and report["cold_equals_warm"], report
    assert report["storage_prefetched_tokens"] is not None, report
