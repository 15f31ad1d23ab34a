"""The speculative flags of ``generate`` and ``demo`` (SGLang's names): bad combinations are one
``error:`` line and exit status 2 before jax is imported; a served run reports its acceptance and
gives the plain run's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.cli import main

ROOT = Path(__file__).resolve().parents[2]
GEN = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3"]
SPEC = ["--speculative-algorithm", "STANDALONE"]

CASES = [
    (GEN + SPEC, ["--speculative-draft-model-path"]),
    (GEN + ["--speculative-num-steps", "2"], ["--speculative-algorithm"]),
    (GEN + ["--speculative-draft-model-path", "tiny"], ["--speculative-algorithm"]),
    (GEN + SPEC + ["--speculative-draft-model-path", "llama-3-8b"], ["vocab_size 128256", "256"]),
    (
        GEN + SPEC + ["--speculative-draft-model-path", "./no-such-draft"],
        ["--speculative-draft-model-path ./no-such-draft", "no such directory"],
    ),
    (GEN + ["--speculative-algorithm", "EAGLE"], ["--model tiny", "checkpoint directory"]),
    (GEN + ["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "2"], ["--speculative-eagle-topk 2"]),
    (GEN + ["--speculative-eagle-topk", "1"], ["--speculative-algorithm"]),
    (GEN + SPEC + ["--speculative-draft-model-path", "tiny", "--speculative-eagle-topk", "1"], ["EAGLE / NEXTN"]),
    (
        GEN + SPEC + ["--speculative-draft-model-path", "tiny", "--speculative-num-draft-tokens", "5"],
        ["--speculative-num-draft-tokens 5", "give 4"],
    ),
    (["demo", "--speculative-algorithm", "EAGLE"], ["--speculative-draft-model-path", "MTP layer"]),
    (["demo"] + SPEC, ["--speculative-draft-model-path"]),
]


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a[5:] if a[0] == "generate" else a) for a, _ in CASES])
def test_bad_speculative_flags_are_one_error_line(argv, words, capsys):
    assert _run(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and "Traceback" not in err
    assert len(lines) == 1 and ": error: " in lines[0], err
    for word in words:
        assert word in err, err


def test_bad_speculative_flags_are_refused_before_jax_is_imported():
    code = (
        "import contextlib, io, json, sys\n"
        "from kvjax.cli import main\n"
        "seen = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "    seen.append([code, 'jax' in sys.modules])\n"
        "print(json.dumps(seen))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    cases = json.dumps([argv for argv, _ in CASES])
    out = subprocess.run(
        [sys.executable, "-c", code, cases], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[2, False]] * len(CASES)


def test_generate_speculatively_gives_the_plain_tokens_and_reports_acceptance(capsys):
    argv = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "1,2,3,4,5,6,7"]
    argv += ["--max-new-tokens", "7", "--ignore-eos", "--page-size", "1", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, *SPEC, "--speculative-draft-model-path", "tiny", "--speculative-num-steps", "2"]) == 0
    out, err = capsys.readouterr()
    spec = json.loads(out)
    assert spec["outputs"] == plain["outputs"]
    assert spec["speculative"]["acceptance_rate"] == 1.0 and spec["speculative"]["num_steps"] == 2
    assert spec["cached_tokens"] == plain["cached_tokens"] > 0
    assert "without overlap scheduling" not in err  # the rounds overlap
    assert spec["speculative"]["overlapped_rounds"] > 0


def test_demo_speculatively_is_leak_free_and_cold_equals_warm(capsys):
    argv = ["demo", "--groups", "1", "--prompts-per-group", "2", "--chats", "1", "--turns", "2"]
    argv += ["--output-tokens", "5", "--system-tokens", "24", "--json", *SPEC, "--speculative-draft-model-path", "tiny"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["leak_free"] and report["cold_equals_warm"] and report["cached_tokens"] > 0
    assert report["speculative"]["acceptance_rate"] == 1.0
