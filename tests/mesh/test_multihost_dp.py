"""DP attention across two processes: the demo workload at dp 2 x tp 4 (``demo --tp 8 --dp 2``)
over 2 processes x 4 CPU devices (``python -m kvjax launch``) gives the tokens of one process
with 8 devices, the same routing, reuse, evictions and retractions; every process runs the same
lockstep DP front (a scheduler per rank) and compares every rank's state digest and the routing
at every step (``KVJAX_CHECK_AGREEMENT=1``); every process ends leak free.

The tiny demo model's 4 query heads split over each rank's 4 devices (its 2 KV heads replicated
to 4); each rank's ``"tp"`` devices are one process's (``group_dp_mesh``). The pools (128 tokens
per rank) are small enough that the runs evict and retract.
"""

from __future__ import annotations

import json

from kvjax.cli import main
from tests.mesh.test_multihost_serving import launch, process_reports

WORKLOAD = ["--groups", "1", "--prompts-per-group", "3", "--chats", "1", "--turns", "2"]
WORKLOAD += ["--system-tokens", "32", "--output-tokens", "3", "--max-total-tokens", "128"]
DP = ["--tp", "8", "--dp", "2"]
SAME = ("rank_requests", "cached_tokens", "prefill_tokens_computed", "evicted_tokens", "retractions")


def test_demo_at_dp_2_tp_4_over_two_processes_gives_the_single_process_tokens(capsys):
    assert main(["demo", *DP, *WORKLOAD, "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["dp_size"] == 2 and single["processes"] == 1, single
    assert min(single["rank_requests"]) > 0, single  # both ranks serve
    assert single["evicted_tokens"] > 0 and single["retractions"] > 0, single

    out = launch(["--processes", "2", "--cpu-devices-per-process", "4", "--", "demo", *DP, *WORKLOAD, "--json"])
    assert out.returncode == 0, out.stderr[-4000:]
    reports = process_reports(out.stdout)
    assert sorted(reports) == [0, 1], out.stdout[-2000:]
    for pid, r in reports.items():
        assert r["processes"] == 2 and r["process_id"] == pid and r["dp_size"] == 2
        assert r["leak_free"] and r["cold_equals_warm"], r
        assert r["digest_checks"] > 0, r  # every rank's digests and the routing compared at every step, all equal
        assert r["outputs_fingerprint"] == single["outputs_fingerprint"], (r, single)
        for key in SAME:
            assert r[key] == single[key], (key, r, single)
