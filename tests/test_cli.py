"""The command line: ``python -m kvjax plan`` and argument handling."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvjax.cli import main, parse_bytes


def test_parse_bytes_units():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1024") == 1024


def test_parse_bytes_rejects_nonsense():
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="16GiB"):
        parse_bytes("lots")


def test_plan_prints_a_table(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "131,072" in out and "req_to_token" in out and "16.00 GiB" in out


def test_plan_json_is_one_object(capsys):
    assert main(["plan", "--model", "gemma-3-12b", "--memory", "24GiB", "--tp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["is_hybrid_swa"] and plan["sliding_window_size"] == 1024
    assert plan["full_tokens_per_layer"] > 0 and plan["swa_tokens_per_layer"] > 0


def test_plan_accepts_a_config_json_path(tmp_path, capsys):
    from importlib import resources

    path = tmp_path / "mymodel" / "config.json"
    path.parent.mkdir()
    path.write_text(resources.files("kvjax.presets").joinpath("qwen2.5-7b.json").read_text())
    assert main(["plan", "--model", str(path), "--memory", "8GiB", "--kv-cache-dtype", "fp8_e4m3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "mymodel" and plan["storage_dtype"] == "float8_e4m3fn"


def test_plan_bad_input_exits_2_with_the_field_named(capsys):
    assert main(["plan", "--model", "no-such-model", "--memory", "1GiB"]) == 2
    assert "model='no-such-model'" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny"]) == 2
    assert "memory_budget_bytes" in capsys.readouterr().err


def test_python_dash_m_kvjax_plan_runs():
    out = subprocess.run(
        [sys.executable, "-m", "kvjax", "plan", "--model", "deepseek-v3", "--memory", "80GiB", "--tp", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["is_mla"] and plan["kv_pool_kind"] == "mla"
