"""``python -m kvjax replay`` end to end: the JSON report's fields, the tables, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvjax.cli import main
from tests.replay._traces import EXCERPT

RESULT_FIELDS = {
    "policy",
    "page_size",
    "capacity_tokens",
    "host_capacity_tokens",
    "dp_size",
    "dp_routing",
    "requests",
    "too_large",
    "prompt_tokens",
    "hit_tokens",
    "device_hit_tokens",
    "host_hit_tokens",
    "token_hit_rate",
    "host_hit_rate",
    "evicted_tokens",
    "evicted_nodes",
    "peak_device_tokens",
    "by_position",
    "per_rank_requests",
    "per_rank_hit_tokens",
    "gap_to_optimum",
    "seconds",
    "requests_per_second",
}


def test_json_report_has_every_field_and_the_optimum(capsys):
    argv = ["replay", "--trace", str(EXCERPT), "--limit", "120", "--page-size", "512", "--capacity-fraction", "0.1"]
    assert main([*argv, "--eviction-policy", "lru,lfu", "--optimum", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trace"]["requests"] == 120 and report["trace"]["format"] == "mooncake"
    assert [r["policy"] for r in report["results"]] == ["lru", "lfu"]
    for r in report["results"]:
        assert set(r) >= RESULT_FIELDS, RESULT_FIELDS - set(r)
        assert r["gap_to_optimum"] >= 0 and r["requests"] == 120
        assert set(r["by_position"]) <= {"0", "1", "2"} and r["by_position"]["0"]["requests"] > 100
    assert report["optimum"]["policy"] == "belady"
    assert report["results"][0]["capacity_tokens"] == int(0.1 * report["trace"]["distinct_blocks"] * 512) // 512 * 512


def test_tables_are_printed_without_json(capsys):
    assert main(["replay", "--trace", str(EXCERPT), "--limit", "50", "--capacity-tokens", "400000", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "50 requests of" in out and "│ lru" in out and "┃ 0 (50) ┃" in out  # requests at position 0


def test_the_token_format(tmp_path, capsys):
    path = tmp_path / "tokens.jsonl"
    path.write_text(
        '{"input_ids": [1, 2, 3, 4], "output_length": 1}\n{"input_ids": [1, 2, 3, 4, 5], "output_length": 0}\n'
    )
    argv = ["replay", "--trace", str(path), "--format", "tokens", "--page-size", "1", "--capacity-tokens", "64"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert (result["prompt_tokens"], result["hit_tokens"]) == (9, 4)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--eviction-policy", "random"], "--eviction-policy random: unknown random"),
        (["--page-size", "0"], "argument --page-size: '0': must be a whole number >= 1"),
        (["--capacity-tokens", "8"], "--capacity-tokens 8: give the device cache at least one page (16 tokens)"),
        (["--optimum", "--dp-size", "2"], "--optimum: the offline optimum is defined for one device cache"),
        (["--capacity-tokens", "64", "--capacity-fraction", "0.1"], "not allowed with argument"),
        (["--format", "csv"], "argument --format: invalid choice"),
    ],
)
def test_bad_flags_are_one_error_line(extra, words, capsys):
    try:
        code = main(["replay", "--trace", str(EXCERPT), *extra])
    except SystemExit as e:  # argparse's own checks exit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and err.startswith("python -m kvjax replay")


def test_a_bad_trace_line_is_named(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    assert main(["replay", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--trace {path}: line 2: 'input_length' is missing" in err and err.count("\n") == 1


def test_a_missing_trace_file(tmp_path, capsys):
    assert main(["replay", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err


def test_the_command_imports_no_jax():
    code = (
        "import sys\nfrom kvjax.cli import main\n"
        f"main(['replay', '--trace', {str(EXCERPT)!r}, '--limit', '5', '--json'])\n"
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["trace"]["requests"] == 5
