"""Decode context parallelism across processes: ``python -m kvjax launch --processes 2
--cpu-devices-per-process 4 -- generate --tp 8 --dcp 2`` gives the tokens and cache reuse of one
process with 8 devices, and the same under DP attention (``--dp 2 --tp 8 --dcp 2``).

The mesh spans both processes (``kvjax.serve.multihost.mesh``): ``("tp", "dcp")`` = ``(4, 2)``,
each ``"dcp"`` pair of devices within one process (4 devices each), the weights split over all 8;
under DP attention ``("data", "tp", "dcp")`` = ``(2, 2, 2)``, a rank on each process. Every
process's state digest is compared at every step (``KVJAX_CHECK_AGREEMENT=1``); only process 0
prints the outputs, and process 1's status line carries the same token count and outputs digest.
The model is the 8-query-head tiny checkpoint of ``test_multihost_generate`` (2 KV heads); MLA's
latent is striped too (``deepseek-tiny`` at ``--tp 4 --dcp 2`` over 2 processes of 2 devices).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from kvjax.cli import main
from tests.mesh.test_multihost_generate import FLAGS, PROMPTS, _lines
from tests.mesh.test_multihost_generate import heads8 as heads8  # noqa: F401, PLC0414  (the fixture)
from tests.mesh.test_multihost_serving import launch

pytestmark = pytest.mark.mesh


@pytest.mark.parametrize(
    "flags", [["--tp", "8", "--dcp", "2"], ["--dp", "2", "--tp", "8", "--dcp", "2"]], ids=["tp", "dp"]
)
def test_generate_with_dcp_over_two_processes_gives_the_single_process_tokens(flags, heads8, capsys):
    _check_over_two_processes(heads8, flags, 4, capsys, PROMPTS)


def test_mla_latent_striped_over_two_processes_gives_the_single_process_tokens(capsys):
    """DeepSeek's MLA latent (``deepseek-tiny``, 4 heads) at tp 4 x dcp 2 over 2 processes of 2
    devices: each process holds one ``"dcp"`` pair, the latent striped by token within it."""
    shared = ",".join(str(t) for t in range(3, 23))  # 20 tokens: the first two prompts share them
    prompts = ["--prompt-ids", f"{shared},30,31", "--prompt-ids", f"{shared},40", "--prompt-ids", "50,51,52"]
    _check_over_two_processes("deepseek-tiny", ["--tp", "4", "--dcp", "2"], 2, capsys, prompts)


def _check_over_two_processes(
    model: str, flags: list[str], devices: int, capsys: pytest.CaptureFixture, prompts: list[str]
) -> None:
    """``generate --model model *flags *prompts`` over 2 processes of ``devices`` devices prints
    what one process prints (reuse of striped pages included); process 1's status line agrees."""
    assert main(["generate", "--model", model, *flags, *prompts, *FLAGS]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["cached_tokens"] > 0, single  # the second prompt reuses the first one's striped pages
    assert [len(o) for o in single["outputs"]] == [4, 4, 4], single
    argv = ["--processes", "2", "--cpu-devices-per-process", str(devices), "--", "generate", "--model", model, *flags]
    out = launch([*argv, *prompts, *FLAGS], timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    printed = _lines(out.stdout, 0)
    assert len(printed) == 1 and json.loads(printed[0]) == single, out.stdout[-2000:]
    assert _lines(out.stdout, 1) == [], out.stdout[-2000:]
    digest = hashlib.sha256(json.dumps(single["outputs"]).encode()).hexdigest()[:16]
    status = [line for line in _lines(out.stderr, 1) if "python -m kvjax generate:" in line]
    assert status == [
        "python -m kvjax generate: process 1 of 2 served 3 prompt(s) in step with process 0: 12 tokens "
        f"generated, outputs sha256 {digest} (process 0 prints them)"
    ], out.stderr[-3000:]
    assert "error" not in out.stderr, out.stderr[-3000:]
