"""Speculative decoding across processes (issue 35): ``python -m kvjax launch --processes 2
--cpu-devices-per-process 2 -- generate --tp 4 --speculative-algorithm ...``, every process's
state digest compared at every step (``KVJAX_CHECK_AGREEMENT=1``).

* EAGLE (NEXTN): the tiny DeepSeek-V2 target of ``tests/serve/test_speculative_eagle.py`` with a
  random MTP layer (so most proposals are rejected and rolled back, on every process alike), the
  latent pools replicated over the 4 devices of the two processes, prefix reuse across prompts and
  chunked prefill (pages of 4, chunks of 8): Transformers' greedy tokens.
* STANDALONE: a tiny preset as its own draft (full attention, Gemma 3's sliding-window pools,
  DeepSeek's MLA latent) accepts every proposal across processes and gives the tokens of one
  process without speculation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.mesh.test_multihost_serving import launch, process_reports
from tests.serve.parity_harness import hf_greedy
from tests.serve.test_speculative_eagle import checkpoints as checkpoints  # noqa: F401, PLC0414  (the fixture)
from tests.serve.test_speculative_eagle import deepseek as deepseek  # noqa: F401, PLC0414

pytestmark = pytest.mark.mesh

GROUP = ["--processes", "2", "--cpu-devices-per-process", "2", "--"]
SHARED = list(range(3, 23))  # 20 tokens: 5 pages of 4, shared by the first two prompts
PROMPTS = [[*SHARED, 30, 31], [*SHARED, 40], [50, 51, 52, 53, 54]]
MAX_NEW = 8
SPECULATIVE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def _prompt_flags() -> list[str]:
    return [arg for prompt in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, prompt)))]


def _served(argv: list[str]) -> dict[str, Any]:
    """Process 0's report of ``launch GROUP generate *argv``; process 1's status line agrees."""
    run = launch([*GROUP, "generate", *argv, *_prompt_flags(), "--max-new-tokens", str(MAX_NEW), "--json"])
    assert run.returncode == 0, run.stderr[-3000:]
    reports = process_reports(run.stdout)
    assert set(reports) == {0}, run.stdout[-2000:]
    status = [line for line in run.stderr.splitlines() if line.startswith("[1] python -m kvjax generate: process 1")]
    assert len(status) == 1 and f"{len(PROMPTS) * MAX_NEW} tokens generated" in status[0], run.stderr[-2000:]
    return reports[0]


@pytest.mark.timeout(600)
def test_eagle_over_two_processes_gives_transformers_tokens(deepseek):  # noqa: F811  (the fixture)
    hf, _, random_mtp, _ = deepseek
    flags = ["--model", str(random_mtp), "--tp", "4", "--page-size", "4", "--chunked-prefill-size", "8"]
    report = _served([*flags, "--speculative-algorithm", "EAGLE", *SPECULATIVE, "--ignore-eos"])
    assert report["outputs"] == [hf_greedy(hf, prompt, MAX_NEW)[0] for prompt in PROMPTS]
    spec = report["speculative"]
    # a random MTP layer is mostly wrong: proposals were rejected and rolled back on both processes
    assert spec["proposed_tokens"] > spec["accepted_tokens"] and spec["rolled_back_slots"] > 0, spec
    # the second prompt's shared pages: under EAGLE the tree keys are bigrams (SGLang's), so the 20
    # shared tokens make 19 keys, 4 whole pages of 4
    assert report["cached_tokens"] == 16, report


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["tiny", "gemma3-tiny", "deepseek-tiny"])
def test_standalone_over_two_processes_accepts_every_proposal_of_the_model_as_its_own_draft(model, capsys):
    from kvjax.cli import main

    flags = ["--model", model, "--page-size", "4", "--ignore-eos"]
    assert main(["generate", *flags, *_prompt_flags(), "--max-new-tokens", str(MAX_NEW), "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    report = _served(
        [*flags, "--tp", "4", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model]
    )
    report_spec = report.pop("speculative")
    assert report["outputs"] == single["outputs"]
    # every proposal accepted (slots past a request's last token are still given back)
    assert report_spec["acceptance_rate"] == 1.0, report_spec
    assert report_spec["accepted_tokens"] == report_spec["proposed_tokens"] > 0, report_spec
