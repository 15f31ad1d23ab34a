"""``generate --dp M`` and ``demo --dp M`` (with ``--tp N``: SGLang's ``--dp M
--enable-dp-attention``) serve DP attention over a ``("data", "tp")`` mesh of the local devices:
the single-device tokens (with overlap scheduling and without), a leak-free demo with cold == warm
whose report names the routing policy and each rank's hit rate; bad combinations are one clear
error naming the flag and the fix.
"""

from __future__ import annotations

import json

import jax
import pytest

from kvjax.cli import main

GENERATE = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3,4,5,6", "--prompt-ids", "1,2,3,4,9", "--json"]
GENERATE += ["--max-new-tokens", "4"]


def test_generate_at_dp_2_tp_4_gives_the_single_device_tokens(capsys):
    assert main(GENERATE) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*GENERATE, "--tp", "4", "--dp", "2", "--dp-routing", "round_robin"]) == 0
    dp = json.loads(capsys.readouterr().out)
    assert dp["outputs"] == single["outputs"]
    assert dp["prompt_tokens"] == single["prompt_tokens"]
    assert dp["cached_tokens"] == 0  # round robin: the second prompt goes to the other rank's empty tree
    # overlap scheduling (the default) off in every rank: the same tokens
    assert main([*GENERATE, "--tp", "4", "--dp", "2", "--disable-overlap-schedule"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"] == single["outputs"]


def test_demo_at_dp_2_reports_each_rank_and_the_routing_policy(capsys):
    argv = [
        "demo",
        "--tp",
        "2",
        "--dp",
        "2",
        "--groups",
        "1",
        "--prompts-per-group",
        "2",
        "--chats",
        "1",
        "--turns",
        "2",
    ]
    assert main([*argv, "--system-tokens", "32", "--output-tokens", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["leak_free"] and report["cold_equals_warm"]
    assert report["dp_size"] == 2 and report["dp_routing"] == "cache_aware"  # the default
    assert sum(report["rank_requests"]) == report["requests"] == 4  # 2 prompts, 2 chat turns
    assert len(report["rank_hit_rates"]) == 2 and report["cached_tokens"] > 0


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tp", "4", "--dp", "3"], ["--dp 3", "does not divide --tp 4", "use --dp 1, 2 or 4"]),
        (["--dp", "2"], ["--dp 2", "does not divide --tp 1", "or a --tp that 2 divides"]),
    ],
)
@pytest.mark.parametrize("command", ["generate", "demo"])
def test_bad_dp_flags_name_the_flag_and_the_fix(command, flags, says, capsys):
    argv = GENERATE if command == "generate" else ["demo"]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    for text in says:
        assert text in err, err


def test_dp_attention_with_the_host_tier(capsys):
    """Every DP rank has its own host tier (``kvjax.dp.rank_transfer``): generate gives the tokens it
    gives without one; the demo's cold and warm runs agree and every rank's host pool balances."""
    argv = [*GENERATE, "--tp", "4", "--dp", "2", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--enable-hierarchical-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"] == plain["outputs"]
    demo = ["demo", "--tp", "4", "--dp", "2", "--enable-hierarchical-cache", "--system-tokens", "32"]
    assert main([*demo, "--output-tokens", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["leak_free"] and report["cold_equals_warm"] and report["host_balanced"], report
    assert report["dp_size"] == 2 and report["host_pool_tokens"] > 0


def test_more_devices_than_local_names_tp(capsys):
    too_many = len(jax.local_devices()) * 2
    assert main([*GENERATE, "--tp", str(too_many), "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert f"--tp {too_many}" in err and f"use --tp {len(jax.local_devices())} or fewer" in err


def test_help_states_the_routing_default(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--dp-routing {cache_aware,round_robin}" in out and "cache_aware, the default" in out
