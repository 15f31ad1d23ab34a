"""The command line: ``python -m kvjax plan``, its flags, answers and error messages."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib import resources

import pytest

from kvjax.chips import TPU_CHIPS, tpu_chip, weights_per_chip
from kvjax.cli import main, parse_bytes

GIB = 2**30


def test_parse_bytes_units():
    assert parse_bytes("16GiB") == 16 * GIB
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1024") == 1024


@pytest.mark.parametrize("text, words", [("lots", "not a size"), ("-1GiB", "positive"), ("0", "positive")])
def test_parse_bytes_rejects_nonsense(text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        parse_bytes(text)


def test_plan_prints_a_table(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "req_to_token" in out and "16.00 GiB" in out


def test_plan_json_is_one_object(capsys):
    assert main(["plan", "--model", "gemma-3-12b", "--memory", "24GiB", "--tp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["is_hybrid_swa"] and plan["sliding_window_size"] == 1024
    assert plan["full_tokens_per_layer"] > 0 and plan["swa_tokens_per_layer"] > 0
    assert plan["answers"] == {}


def test_plan_accepts_a_config_json_path(tmp_path, capsys):
    path = tmp_path / "mymodel" / "config.json"
    path.parent.mkdir()
    path.write_text(resources.files("kvjax.presets").joinpath("qwen2.5-7b.json").read_text())
    assert main(["plan", "--model", str(path), "--memory", "8GiB", "--kv-cache-dtype", "fp8_e4m3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "mymodel" and plan["storage_dtype"] == "float8_e4m3fn"


def test_context_and_concurrency_answers_match_the_plan(capsys):
    from kvjax import CacheConfig, ModelSpec, plan_kv_cache

    argv = ["plan", "--model", "llama-3-8b", "--memory", "16GiB", "--context", "4096", "--concurrency", "64"]
    assert main([*argv, "--json"]) == 0
    answers = json.loads(capsys.readouterr().out)["answers"]
    plan = plan_kv_cache(ModelSpec.preset("llama-3-8b"), CacheConfig(memory_budget_bytes=16 * GIB))
    assert answers == {"requests_that_fit": plan.requests_that_fit(4096), "max_context": plan.max_context_for(64)}
    assert answers["requests_that_fit"] > 0 and 0 < answers["max_context"] <= 8192
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"requests of 4,096 tokens that fit at once: {answers['requests_that_fit']:,}" in out
    assert f"longest context for 64 concurrent requests: {answers['max_context']:,} tokens" in out


def test_tpu_chip_presets():
    assert {n: c.hbm_bytes // GIB for n, c in TPU_CHIPS.items()} == {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
    assert tpu_chip("v5litepod").name == "v5e" and tpu_chip("v5e").slice_name(8) == "v5e-8"
    assert weights_per_chip(16 * 10**9, 8) == 2 * 10**9


def test_what_fits_on_a_v5e_8_is_one_command(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--tpu", "v5e", "--chips", "8", "--weights-bytes", "16GB", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    # 16 GiB x 0.9 - 16e9 / 8 bytes of weights per chip; tp defaults to the chip count.
    assert plan["kv_budget_bytes"] == int(16 * GIB * 0.9) - 2 * 10**9
    assert plan["num_kv_heads_per_rank"] == 1
    assert plan["device_bytes"] <= plan["kv_budget_bytes"]
    assert plan["sizing"]["chips"] == 8 and plan["sizing"]["replicas"] == 1
    assert main(["plan", "--model", "llama-3-8b", "--tpu", "v5e", "--chips", "8"]) == 0
    assert "weights not subtracted" in capsys.readouterr().out


def test_sweep_prints_a_row_per_combination(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--memory", "16GiB", "--sweep", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 4 * 2 * 4
    by_key = {(r["tp"], r["page_size"], r["kv_cache_dtype"]): r for r in rows}
    assert by_key[(1, 16, "fp8_e4m3")]["bytes_per_token"] * 2 == by_key[(1, 16, "auto")]["bytes_per_token"]
    # Qwen2.5-7B's 28 attention heads do not split over 8 ranks: refused in its row, naming the flag.
    assert "--tp 8" in by_key[(8, 16, "auto")]["refused"]
    assert main(["plan", "--model", "qwen2.5-7b", "--memory", "16GiB", "--sweep"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["tp", "page", "kv"] and len(table) == 1 + 32


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "no-such-model", "--memory", "1GiB"], ["--model no-such-model", "no such preset"]),
        (["--model", "missing/config.json", "--memory", "1GiB"], ["--model missing/config.json", "no such file"]),
        (["--model", "tiny"], ["--memory is missing", "--tpu", "--max-total-tokens"]),
        (["--model", "tiny", "--memory", "-1GiB"], ["--memory", "-1GiB", "positive"]),
        (["--model", "tiny", "--memory", "lots"], ["--memory", "lots", "16GiB"]),
        (["--model", "llama-3-8b", "--memory", "16GiB", "--tp", "3"], ["--tp 3", "--tp"]),
        (["--model", "llama-3-8b", "--memory", "16GiB", "--page-size", "3"], ["--page-size 3"]),
        (["--model", "tiny", "--memory", "1GiB", "--tpu", "v5e"], ["--memory", "--tpu", "one of them"]),
        (["--model", "tiny", "--memory", "1GiB", "--weights-bytes", "1GB"], ["--weights-bytes", "needs --tpu"]),
        (["--model", "tiny", "--tpu", "v5e", "--chips", "3", "--tp", "2"], ["--chips 3", "--tp 2"]),
        (["--model", "tiny", "--tpu", "v9"], ["--tpu", "v9", "v5e"]),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv, words, capsys):
    assert _exit_code(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    for python_word in ("memory_budget_bytes", "mem_fraction_static", "or None"):
        assert python_word not in err, err


def _exit_code(argv: list[str]) -> int:
    """``main``'s return value, or the status argparse exits with."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def test_python_dash_m_kvjax_plan_runs_without_jax():
    code = (
        "import sys; from kvjax.cli import main; "
        "rc = main(['plan', '--model', 'deepseek-v3', '--memory', '80GiB', '--tp', '8', '--json']); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'pallas_kernels')); "
        "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["is_mla"] and plan["kv_pool_kind"] == "mla"
    assert "HEAVY []" in out.stderr


def test_a_closed_pipe_ends_quietly():
    # The reader is gone before the command writes a byte: its first write meets a closed pipe.
    cmd = [sys.executable, "-m", "kvjax", "plan", "--model", "llama-3-8b", "--memory", "16GiB", "--sweep"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
