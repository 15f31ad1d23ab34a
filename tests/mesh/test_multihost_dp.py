"""DP attention across two processes: the demo workload at dp 2 x tp 4 (``demo --tp 8 --dp 2``)
over 2 processes x 4 CPU devices (``python -m kvjax launch``) gives the tokens of one process
with 8 devices, the same routing, reuse, evictions and retractions; every process runs the same
lockstep DP front (a scheduler per rank) and compares every rank's state digest and the routing
at every step (``KVJAX_CHECK_AGREEMENT=1``); every process ends leak free.

The tiny demo model's 4 query heads split over each rank's 4 devices (its 2 KV heads replicated
to 4); each rank's ``"tp"`` devices are one process's (``group_dp_mesh``). The pools (128 tokens
per rank) are small enough that the runs evict and retract. The digest of a DP front (checked on
its own) has every rank's parts and the routing, and a divergence names the rank, the part and
the routing.

The launch is the README's DP attention command, run as written (``readme_command``) with
``--json`` for the reports: the README test leaves it to this one.
"""

from __future__ import annotations

import json
import shlex

import pytest

from kvjax.cli import main
from tests.mesh.test_multihost_serving import launch, process_reports
from tests.test_readme import readme_command

#: The README's command: ``launch`` over 2 processes x 4 devices of ``demo --tp 8 --dp 2`` and the
#: workload (a pool of 128 tokens per rank: the runs evict and retract).
README = readme_command("python -m kvjax launch --processes 2 --cpu-devices-per-process 4 -- demo --tp 8 --dp 2")
LAUNCH = shlex.split(README)[4:]  # after ``python -m kvjax launch``
DEMO = LAUNCH[LAUNCH.index("--") + 1 :]
SAME = ("rank_requests", "cached_tokens", "prefill_tokens_computed", "evicted_tokens", "retractions")


def test_demo_at_dp_2_tp_4_over_two_processes_gives_the_single_process_tokens(capsys):
    assert DEMO[:5] == ["demo", "--tp", "8", "--dp", "2"], README
    assert main([*DEMO, "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["dp_size"] == 2 and single["processes"] == 1, single
    assert min(single["rank_requests"]) > 0, single  # both ranks serve
    assert single["evicted_tokens"] > 0 and single["retractions"] > 0, single

    out = launch([*LAUNCH, "--json"])
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


def test_the_dp_digest_names_the_rank_and_the_part_that_differ_and_the_routing():
    from kvjax import ModelSpec
    from kvjax.dp.scheduler import DPScheduler
    from kvjax.multihost.digest import PARTS, compare_digests, serving_digest
    from kvjax.multihost.errors import DivergenceError
    from kvjax.serve.model import init_params
    from kvjax.serve.scheduler import ServingReq
    from tests.serve.dp_serving import dp2_config

    spec = ModelSpec.preset("tiny")
    params = init_params(spec, seed=0)
    fronts = [DPScheduler.build(spec, dp2_config(), params, policy="round_robin") for _ in range(2)]
    for front in fronts:
        front.submit([ServingReq(f"r{i}", [1, 2, 3, 4 + i], max_new_tokens=2) for i in range(2)])
    digests = [serving_digest(front) for front in fronts]
    assert set(digests[0]) == {f"rank {r} {part}" for r in (0, 1) for part in PARTS} | {"routing"}
    compare_digests(0, digests)  # equal states: nothing raised

    fronts[1].submit([ServingReq("extra", [5, 6, 7], max_new_tokens=2)])  # round robin: rank 0
    with pytest.raises(DivergenceError, match=r"process 1's rank 0 requests, routing differ"):
        compare_digests(1, [digests[0], serving_digest(fronts[1])])
