"""``generate`` across processes: text prompts at tp 8 over 2 processes x 4 CPU devices
(``python -m kvjax launch -- generate``) give the tokens, texts and cache reuse of one process
with 8 devices; only process 0 prints them, process 1 prints one status line whose token count
and outputs digest are process 0's; the same under DP attention (dp 2 x tp 4, a rank on each
process); every process's state digest is compared at every step (``KVJAX_CHECK_AGREEMENT=1``).
Processes given different prompts stop with one ``error:`` line each, before anything is built;
what is not served across processes yet is refused before jax starts.

The model is the tiny preset with 8 query heads (its 4 cannot be split 8 ways) and random
weights, saved as a checkpoint with a word-level tokenizer (``w0`` .. ``w255``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from kvjax import ModelSpec
from kvjax.cli import main
from kvjax.multihost.cluster_secret import ClusterSecret
from kvjax.serve.multihost.launcher import free_port
from tests.mesh.multihost_group import child_env
from tests.mesh.subprocess_run import ROOT
from tests.mesh.test_multihost_serving import launch

SYSTEM = " ".join(f"w{i}" for i in range(10, 30))  # 20 tokens: 5 pages of 4, shared by the first two prompts
PROMPTS = ["--prompt", f"{SYSTEM} w1 w2", "--prompt", f"{SYSTEM} w3", "--prompt", "w7 w8 w9"]
FLAGS = ["--max-new-tokens", "4", "--ignore-eos", "--page-size", "4", "--json"]


@pytest.fixture(scope="module")
def heads8(tmp_path_factory) -> str:
    """The tiny preset with 8 query heads over 2 KV heads, saved with a tokenizer: its directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvjax.serve.checkpoint import save_checkpoint
    from kvjax.serve.model import init_params

    tiny = ModelSpec.preset("tiny")
    spec = ModelSpec.from_hf_config({**tiny.extra, "num_attention_heads": 8}, name="tiny-8-heads")
    assert spec.num_attention_heads == 8 and spec.num_kv_heads == 2
    directory = save_checkpoint(tmp_path_factory.mktemp("heads8"), spec, init_params(spec))
    words = {f"w{i}": i for i in range(spec.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return str(directory)


def _lines(text: str, process: int) -> list[str]:
    """What process ``process`` printed (the launcher's ``[i]`` prefix removed), less the CPU
    collectives' connection lines (``[Gloo] Rank 0 is connected to 3 peer ranks ...``). The
    processes write those in pieces, so a line may hold a piece of one: a line naming gloo or
    peer ranks, or holding only a rank count, is such a piece (never what ``generate`` prints)."""
    prefix = f"[{process}] "
    lines = [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]
    return [line for line in lines if not _gloo_piece(line)]


def _gloo_piece(line: str) -> bool:
    return "[Gloo]" in line or "peer ranks" in line or line.strip().isdigit()


def test_generate_at_tp_8_over_two_processes_gives_the_single_process_tokens(heads8, capsys):
    assert main(["generate", "--model", heads8, "--tp", "8", *PROMPTS, *FLAGS]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["cached_tokens"] == 20, single  # the second prompt reuses the first one's 5 pages
    assert [len(o) for o in single["outputs"]] == [4, 4, 4], single

    argv = ["--processes", "2", "--cpu-devices-per-process", "4", "--", "generate", "--model", heads8, "--tp", "8"]
    out = launch([*argv, *PROMPTS, *FLAGS], timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    printed = _lines(out.stdout, 0)
    assert len(printed) == 1 and json.loads(printed[0]) == single, out.stdout[-2000:]
    assert _lines(out.stdout, 1) == [], out.stdout[-2000:]  # the outputs are process 0's to print
    digest = hashlib.sha256(json.dumps(single["outputs"]).encode()).hexdigest()[:16]
    status = [line for line in _lines(out.stderr, 1) if "python -m kvjax generate:" in line]
    assert status == [
        "python -m kvjax generate: process 1 of 2 served 3 prompt(s) in step with process 0: 12 tokens "
        f"generated, outputs sha256 {digest} (process 0 prints them)"
    ], out.stderr[-3000:]
    assert "error" not in out.stderr, out.stderr[-3000:]


def test_generate_under_dp_attention_over_two_processes_gives_the_single_process_tokens(heads8, capsys):
    dp = ["--tp", "8", "--dp", "2"]  # a rank of 4 devices on each process
    assert main(["generate", "--model", heads8, *dp, *PROMPTS, *FLAGS]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["cached_tokens"] == 20, single  # cache-aware routing: the second prompt joins the first's rank

    argv = ["--processes", "2", "--cpu-devices-per-process", "4", "--", "generate", "--model", heads8, *dp]
    out = launch([*argv, *PROMPTS, *FLAGS], timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    printed = _lines(out.stdout, 0)
    assert len(printed) == 1 and json.loads(printed[0]) == single, out.stdout[-2000:]
    assert _lines(out.stdout, 1) == [], out.stdout[-2000:]


def test_processes_given_different_prompts_stop_with_one_error_line_each():
    port = free_port()
    env = child_env(secret=ClusterSecret.generate().hex())
    procs = []
    for i, prompts in enumerate((["--prompt-ids", "1,2,3"], ["--prompt-ids", "1,2,3", "--prompt-ids", "4,5"])):
        argv = [sys.executable, "-m", "kvjax", "generate", "--model", "tiny", "--tp", "2", *prompts]
        argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        argv += ["--local-cpu-devices", "1", "--process-timeout", "20"]
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, results, strict=True):
        errors = [line for line in stderr.decode().splitlines() if "error" in line]
        assert p.returncode == 1, stderr.decode()[-3000:]
        assert stdout.decode() == "", stdout.decode()
        assert errors == [
            "python -m kvjax generate: error: process 1 was given 2 prompt(s) and process 0 1; every process of a "
            "multi-process generate runs the same command (the same prompts and generation flags)"
        ], stderr.decode()[-3000:]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--pp", "2"], "--pp 2 across processes"),
        (["--image", "missing.png"], "--image missing.png across processes"),
    ],
)
def test_what_several_processes_do_not_serve_is_refused_before_jax(flags, named, capsys):
    group = ["--num-processes", "2", "--process-id", "0", "--coordinator", f"127.0.0.1:{free_port()}"]
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,2,3", *flags, *group]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "--tp, --dp, --dcp and speculative decoding only" in err, err
