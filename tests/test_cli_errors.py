"""Bad input on every sub-command, tried as a new user would: exit status 2, one ``error:`` line
naming a flag the command has, no traceback, and nothing imported or built first (jax stays
unloaded until every argument has been checked)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvjax.cli import main
from kvjax.cli.demo_command import storage_dir

ROOT = Path(__file__).resolve().parent.parent
ERROR_LINE = re.compile(r"^python -m kvjax( (plan|demo|generate))?: error: \S")

GEN = ["--model", "tiny", "--prompt-ids", "1,2"]
STANDALONE = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "tiny"]

# (argv, words the error line must contain). Each is refused before jax is imported.
CASES = [
    # generate
    (["generate", "--model", "tiny", "--prompt-ids", "1,2", "--page-size", "0"], ["--page-size", "'0'", ">= 1"]),
    (["generate", "--model", "tiny", "--prompt-ids", "1,2", "--max-batch-size", "0"], ["--max-batch-size", ">= 1"]),
    (["generate", "--model", "tiny", "--prompt-ids", "1,2", "--chunked-prefill-size", "-1"], ["--chunked-prefill"]),
    (["generate", "--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["generate", "--model", "tiny", "--prompt-ids", "-1,2"], ["--prompt-ids -1,2", "token id -1 is out of range"]),
    (["generate", "--model", "tiny", "--prompt-ids", "1,256"], ["token id 256 is out of range", "[0, 256)"]),
    (["generate", "--model", "tiny", "--prompt-ids", "1,x"], ["--prompt-ids 1,x", "comma-separated integers"]),
    (["generate", "--model", "tiny"], ["give at least one prompt", "--prompt-ids"]),
    (["generate", "--model", "tiny", "--prompt-ids", "1", "--retention-seconds", "-1"], ["--retention-seconds", "-1"]),
    (["generate", "--model", "tiny", "--prompt-ids", "1", "--retention-seconds", "nan"], ["retention-seconds", "nan"]),
    (
        ["generate", "--model", "tiny", "--prompt-ids", "1", "--prompt-ids", "2", *["--priority", "1"] * 3],
        ["--priority is given 3 times for 2 prompts"],
    ),
    (["generate", "--model", "./missing-dir", "--prompt", "hello"], ["--model ./missing-dir", "no such directory"]),
    (["generate", "--model", "no-such-preset", "--prompt-ids", "1"], ["--model no-such-preset", "no such preset"]),
    (["generate", "--model", "README.md", "--prompt-ids", "1"], ["--model README.md", "is a file"]),
    (["generate", "--model", "tiny", "--prompt", "hello"], ["--prompt 'hello'", "no tokenizer.json"]),
    (
        ["generate", "--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "5000"],
        ["--max-new-tokens 5000", "context"],
    ),
    (
        ["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "30", "--max-total-tokens", "16"],
        ["--max-total-tokens 16", "--max-total-tokens 48 or more"],
    ),
    # generate: refused combinations (kvjax.cli.combination_flags), both flags named, SGLang's check where it has one
    (
        ["generate", *GEN, "--pp", "2", *STANDALONE],
        ["--pp 2 with --speculative-algorithm", "check_pipeline_parallel_compat"],
    ),
    (["generate", *GEN, "--tp", "2", "--dcp", "3"], ["--dcp 3", "--tp 2"]),
    (
        ["generate", "--model", "qwen3-next-80b-a3b", "--prompt-ids", "1", "--pp", "2", "--enable-hierarchical-cache"],
        ["--pp 2 with --enable-hierarchical-cache", "recurrent-state checkpoints over pipeline stages"],
    ),
    (
        [
            "demo",
            "--model",
            "qwen3-next-80b-a3b",
            "--tp",
            "2",
            "--dp",
            "2",
            "--enable-hierarchical-cache",
            "--hicache-storage",
            "store",
        ],
        ["--hicache-storage store with --model qwen3-next-80b-a3b", "recurrent-state tree with --dp 2"],
    ),
    (["generate", *GEN, "--tp", "2", "--dp", "2", "--image", "x.png"], ["--image x.png with --dp 2"]),
    (
        ["generate", *GEN, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "llama-3-8b"],
        ["--speculative-draft-model-path llama-3-8b", "vocab_size 128256", "the target's is 256"],
    ),
    (
        ["generate", *GEN, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "deepseek-tiny"],
        ["--speculative-draft-model-path deepseek-tiny with --model tiny", "['mla'] layers"],
    ),
    # demo
    (["demo", "--pp", "2", *STANDALONE], ["--pp 2 with --speculative-algorithm STANDALONE", "SGLang"]),
    (
        ["demo", "--tp", "2", "--dcp", "2", "--enable-hierarchical-cache", "--hicache-storage", "store"],
        ["--dcp 2 with --hicache-storage store", "resolve_hicache_dcp_compatibility"],
    ),
    (
        ["demo", "--model", "gemma3-tiny", "--pp", "2", "--enable-hierarchical-cache", "--hicache-storage", "store"],
        ["--hicache-storage store with --model gemma3-tiny", "sliding-window tree with --pp 2"],
    ),
    (["demo", "--output-tokens", "0"], ["--output-tokens", "'0'", ">= 1"]),
    (["demo", "--system-tokens", "-5"], ["--system-tokens", "'-5'", ">= 0"]),
    (["demo", "--seed", "-1"], ["--seed", ">= 0"]),
    (["demo", "--turns", "0"], ["--turns", ">= 1"]),
    (["demo", "--groups", "0", "--chats", "0"], ["--groups 0", "--chats 0", "no request"]),
    (["demo", "--system-tokens", "5000"], ["--system-tokens 5000", "context of 1,024"]),
    (["demo", "--max-total-tokens", "1"], ["--max-total-tokens 1", "page of 16 tokens"]),
    (["demo", "--max-total-tokens", "100"], ["--max-total-tokens 100", "--max-total-tokens 304 or more"]),
    (["demo", "--page-size", "0"], ["--page-size", ">= 1"]),
    (["demo", "--chunked-prefill-size", "-1"], ["--chunked-prefill-size", ">= 1"]),
    (["demo", "--radix-eviction-policy", "bogus"], ["--radix-eviction-policy", "'bogus'", "lru"]),
    (["demo", "--dtype", "float32"], ["--dtype float32", "--model DIR"]),
    (["demo", "--model", "./missing-dir"], ["--model ./missing-dir", "no such directory"]),
    (["demo", "--hicache-storage", "somewhere"], ["--hicache-storage somewhere", "--enable-hierarchical-cache"]),
    (["demo", "--enable-hierarchical-cache", "--hicache-storage", "README.md"], ["README.md", "not a directory"]),
    # plan
    (["plan", "--model", "tiny", "--memory", "1GiB", "--page-size", "1000000"], ["--page-size 1000000", "smaller"]),
    (["plan", "--model", "tiny", "--memory", "10KiB"], ["--memory 10240", "at least"]),
    (["plan", "--model", "llama-3-8b", "--tpu", "v5e", "--chips", "3"], ["--chips 3", "use --chips 1, 2, 4, 8"]),
    (["plan", "--model", "qwen2.5-7b", "--memory", "16GiB", "--tp", "8"], ["--tp 8", "use --tp 1, 2, 4 or 28"]),
    (["plan", "--model", "qwen2.5-7b", "--memory", "16GiB", "--tp", "7"], ["--tp 7", "use --tp 1, 2, 4 or 28"]),
    (["plan", "--model", "llama-3-8b", "--memory", "16GiB", "--pp", "64"], ["--pp 64", "32 layers", "--pp 32"]),
    (["plan", "--model", "tiny", "--max-total-tokens", "3"], ["--max-total-tokens 3", "page of 16 tokens"]),
    (["plan", "--model", "tiny", "--memory", "-1GiB"], ["--memory", "positive"]),
    (["plan", "--model", "tiny"], ["--memory is missing"]),
    # the dispatcher
    (["serve"], ["invalid choice: 'serve'"]),
    ([], ["required"]),
]
# Words that would mean an error names a flag the command does not have, or a Python value.
WRONG_WORDS = {
    "demo": ["--memory", "--model None", "--tp"],
    "generate": ["--memory", "--model None"],
    "plan": ["memory_budget_bytes", "page_size", "tp_size", "or None", "{"],
}


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a) or "(none)" for a, _ in CASES])
def test_bad_input_is_one_error_line_and_exit_2(argv, words, capsys):
    assert _run(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and ERROR_LINE.match(lines[0]), err
    assert "Traceback" not in err and out == "", (out, err)
    for word in words:
        assert word in err, err
    for word in WRONG_WORDS.get(argv[0] if argv else "", []):
        assert word not in err, err


def test_every_case_is_refused_before_jax_is_imported():
    """All of ``CASES`` in one fresh interpreter: after each refusal, jax is still not loaded."""
    code = (
        "import contextlib, io, json, sys\n"
        "from kvjax.cli import main\n"
        "seen = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "    seen.append([argv, code, 'jax' in sys.modules])\n"
        "print(json.dumps(seen))\n"
    )
    cases = json.dumps([argv for argv, _ in CASES])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run(
        [sys.executable, "-c", code, cases], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert [argv for argv, code, _ in seen if code != 2] == []
    assert [argv for argv, _, jax_loaded in seen if jax_loaded] == []


def test_an_mtp_draft_of_another_hidden_size_is_refused_from_its_config(tmp_path, capsys):
    """EAGLE with another checkpoint's MTP layer: its config.json alone says the hidden size does
    not fit the target's (one line naming the flag and both sizes; no weights there to read)."""
    from kvjax.spec import ModelSpec

    spec = ModelSpec.preset("deepseek-tiny")
    config = dict(spec.extra, torch_dtype=spec.dtype, num_nextn_predict_layers=1, hidden_size=2 * spec.hidden_size)
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["generate", "--model", "deepseek-tiny", "--prompt-ids", "1", "--speculative-algorithm", "EAGLE"]
    assert _run([*argv, "--speculative-draft-model-path", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and ERROR_LINE.match(err), err
    want = f"--speculative-draft-model-path {tmp_path}: hidden_size {2 * spec.hidden_size}, the target's is "
    assert want + str(spec.hidden_size) in err, err


def test_a_standalone_draft_for_a_target_without_draft_pools_is_refused_from_its_config(tmp_path, capsys):
    """DeepSeek-V3.2 (DSA indexer keys): no draft pool is planned for it, so a STANDALONE draft is
    one line naming both flags, from config.json alone (no weights there)."""
    (tmp_path / "config.json").write_text((ROOT / "tests/data/hf_configs/deepseek-v3.2.json").read_text())
    argv = ["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--speculative-algorithm", "STANDALONE"]
    assert _run([*argv, "--speculative-draft-model-path", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and ERROR_LINE.match(err), err
    assert f"--speculative-draft-model-path {tmp_path} with --model {tmp_path}: draft KV pools for a DSA" in err, err


# --- the storage directory (--hicache-storage) ------------------------------------------------------


def test_a_missing_storage_directory_is_created_and_said_so(tmp_path, capsys, monkeypatch):
    import kvjax.demo

    class Report:
        ok = True

        def to_dict(self):
            return {"served": True}

    seen = {}

    def fake_run_demo(**kwargs):
        seen.update(kwargs)
        return Report()

    monkeypatch.setattr(kvjax.demo, "run_demo", fake_run_demo)
    target = tmp_path / "a" / "store"
    argv = ["demo", "--enable-hierarchical-cache", "--hicache-storage", str(target), "--json"]
    assert _run(argv) == 0
    out, err = capsys.readouterr()
    assert target.is_dir() and seen["hicache_storage"] == str(target)
    assert err.splitlines() == [f"python -m kvjax demo: created the --hicache-storage directory {target}"]
    assert json.loads(out) == {"served": True}
    assert _run(argv) == 0  # there now: nothing said
    assert capsys.readouterr().err == ""


def test_storage_directory_checks(tmp_path):
    assert storage_dir(None, host_tier=False) == (None, False)
    assert storage_dir(str(tmp_path), host_tier=True) == (tmp_path, False)
    assert storage_dir(str(tmp_path / "new"), host_tier=True) == (tmp_path / "new", True)
    assert not (tmp_path / "new").exists()  # created by the command, after every other check


def _unwritable_directory() -> Path | None:
    """A directory this process cannot create files in (root ignores permission bits)."""
    locked = Path(tempfile.mkdtemp())
    locked.chmod(0o500)
    try:
        (locked / "probe").touch()
    except OSError:
        return locked
    for candidate in (Path("/sys/fs"), Path("/proc")):
        try:
            fd, name = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.unlink(name)
    return None


def test_an_unwritable_storage_directory_is_refused(capsys):
    directory = _unwritable_directory()
    if directory is None:
        pytest.skip("no unwritable directory on this machine")
    for path, words in ((directory, "is not writable"), (directory / "sub", "its parent")):
        assert _run(["demo", "--enable-hierarchical-cache", "--hicache-storage", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


# --- help ---------------------------------------------------------------------------------------------


def test_top_level_help_speaks_to_users(capsys):
    assert _run(["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m kvjax plan --model llama-3-8b --memory 16GiB" in out
    for internal in ("``", "add_parser", "run(args)", "module"):
        assert internal not in out, out


@pytest.mark.parametrize("command", ["plan", "demo", "generate"])
def test_command_help_has_no_restructured_text(command, capsys):
    assert _run([command, "--help"]) == 0
    assert "``" not in capsys.readouterr().out
