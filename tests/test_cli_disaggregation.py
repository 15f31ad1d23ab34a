"""The disaggregation flags of ``generate`` and ``demo`` (``kvjax.cli.disaggregation_flags``): each
bad combination is one ``error:`` line (exit status 2) naming the flag and the fix, before jax is
imported. The served runs are ``tests/mesh/test_pd_cli.py``'s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.cli import main
from kvjax.cli.disaggregation_flags import parse_address
from kvjax.cli.messages import UsageError

ROOT = Path(__file__).resolve().parent.parent
SECRET = "ab" * 32
GEN = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3"]
DECODE = ["--disaggregation-mode", "decode", "--disaggregation-prefill-addr", "127.0.0.1:8998"]

# (argv, words the error line must contain)
CASES = [
    (
        [*GEN, "--disaggregation-mode", "decode"],
        ["--disaggregation-mode decode needs a prefill server", "--disaggregation-prefill-addr HOST:PORT"],
    ),
    (
        [*GEN, "--disaggregation-prefill-addr", "127.0.0.1:8998"],
        ["is for a decode server", "--disaggregation-mode decode"],
    ),
    ([*GEN, "--disaggregation-bootstrap-port", "9000"], ["--disaggregation-bootstrap-port 9000", "prefill"]),
    ([*GEN, "--disaggregation-timeout", "5"], ["--disaggregation-timeout 5", "decode"]),
    ([*GEN, "--host", "0.0.0.0"], ["--host 0.0.0.0", "--disaggregation-mode prefill or decode"]),
    (
        ["generate", "--model", "tiny", "--disaggregation-mode", "prefill", "--host", "203.0.113.7"],
        ["--host 203.0.113.7", "cannot listen there", "an address of this host"],  # TEST-NET-3: not here
    ),
    (
        [*GEN, "--disaggregation-mode", "decode", "--disaggregation-prefill-addr", "localhost"],
        ["localhost", "HOST:PORT"],
    ),
    ([*GEN, "--disaggregation-mode", "decode", "--disaggregation-prefill-addr", "h:99999"], ["h:99999", "HOST:PORT"]),
    ([*GEN, "--disaggregation-mode", "decode", "--disaggregation-prefill-addr", ":80"], [":80", "HOST:PORT"]),
    ([*GEN, *DECODE, "--dp", "2", "--tp", "2"], ["--dp 2", "not served disaggregated yet"]),
    ([*GEN, *DECODE, "--pp", "2"], ["--pp 2", "not served disaggregated yet"]),
    (
        [*GEN, *DECODE, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "tiny"],
        ["--speculative-algorithm", "not served disaggregated yet"],
    ),
    (  # generate serves either side as several processes; demo does not
        ["demo", *DECODE, "--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1234"],
        ["--num-processes", "not served disaggregated yet"],
    ),
    ([*GEN, "--disaggregation-mode", "prefill"], ["takes no prompts"]),
    (
        ["generate", "--model", "tiny", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "70000"],
        ["70000"],
    ),
    (["demo", "--disaggregation-mode", "decode"], ["--disaggregation-mode decode needs a prefill server"]),
    (
        ["demo", "--disaggregation-mode", "prefill", "--dp", "2", "--tp", "2"],
        ["--dp 2", "not served disaggregated yet"],
    ),
    (["demo", "--disaggregation-prefill-addr", "127.0.0.1:8998"], ["is for a decode server"]),
    (["generate", "--model", "tiny", "--disaggregation-mode", "both"], ["--disaggregation-mode", "both"]),
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a[2:] if a[0] == "generate" else a) for a, _ in CASES])
def test_bad_disaggregation_flags_are_one_error_line(argv, words, capsys, monkeypatch):
    monkeypatch.setenv("KVJAX_CLUSTER_SECRET", SECRET)
    code: int | str | None
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m kvjax"), err
    assert "error:" in lines[0] and "Traceback" not in err
    for word in words:
        assert word in err, err


def test_a_missing_or_malformed_secret_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("KVJAX_CLUSTER_SECRET", raising=False)
    assert main([*GEN, *DECODE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no cluster secret" in err and "KVJAX_CLUSTER_SECRET" in err, err
    monkeypatch.setenv("KVJAX_CLUSTER_SECRET", "not-hex")
    assert main(["generate", "--model", "tiny", "--disaggregation-mode", "prefill"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "KVJAX_CLUSTER_SECRET" in err and "hex" in err, err


def test_parse_address():
    assert parse_address("127.0.0.1:8998") == ("127.0.0.1", 8998)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("8998", "host:", "host:x", "host:0", ":1"):
        with pytest.raises(UsageError, match="HOST:PORT"):
            parse_address(bad)


def test_every_case_is_refused_before_jax_is_imported():
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
        "    seen.append([argv, code, 'jax' in sys.modules])\n"
        "print(json.dumps(seen))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    env["KVJAX_CLUSTER_SECRET"] = SECRET
    cases = json.dumps([argv for argv, _ in CASES])
    out = subprocess.run(
        [sys.executable, "-c", code, cases], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert [argv for argv, code, _ in seen if code != 2] == []
    assert [argv for argv, _, jax_loaded in seen if jax_loaded] == []


def test_each_failed_request_is_an_error_line_and_exit_1(capsys):
    from kvjax.cli.disaggregation_flags import failed_requests

    assert failed_requests("generate", None) == 0
    assert failed_requests("generate", {"failed": []}) == 0
    failed = [
        {"prompt": 2, "reason": "prefill server p sent no first token within 5 s"},
        {"request": "c0.1", "reason": "x"},
    ]
    assert failed_requests("generate", {"failed": failed}) == 1
    assert capsys.readouterr().err.splitlines() == [
        "python -m kvjax generate: error: prompt 2 failed: prefill server p sent no first token within 5 s",
        "python -m kvjax generate: error: request c0.1 failed: x",
    ]
